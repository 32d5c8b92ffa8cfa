#!/usr/bin/env bash
# Benchmark P1 (Little's law): one worker against the mock provider at a fixed latency, for
# several in-flight windows, next to the ideal (window / latency). Each point runs RUNS times,
# each run on its own schema, topic and mock; the table gives the median and the spread.
#
# The rate is the steady state, from the database clock: the calls started between the first
# claim after the first window's worth (the window has turned over once) and the first claim of
# the last window's worth, over that interval. While the window is the limit, calls start as
# fast as they finish; start-up, group join, the first wave and the last one's drain are not
# counted, and waves of exactly one latency give exactly window / latency. Also shown: the most calls the mock saw open
# at once (the window the worker really kept full), and the worker's and the mock's CPU time per
# record (they share the box: what the mock spends, the worker cannot).
#
# Usage: deploy/bench-window.sh [latency_ms] [partitions] [runs] [windows...]
#        (default: 1000 1 3 1 16 64 256 1024). Extra settings: BENCH_WORKER, BENCH_LIBRDKAFKA
#        (section.key=VALUE pairs as deploy/lib.sh's write_settings takes them, separated by
#        spaces or newlines, e.g. BENCH_WORKER=worker.read_ahead=128 or
#        BENCH_LIBRDKAFKA='kafka.librdkafka."fetch.wait.max.ms"="10"'),
#        BENCH_PARTITION_WINDOW (default: the window), BENCH_POOL_SIZE (default: 8).
# Writes the table to stdout and one JSON line per run to target/bench/window.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
latency_ms=${1:-1000}
partitions=${2:-1}
runs=${3:-3}
shift 3 || true
windows=("$@")
[ ${#windows[@]} -gt 0 ] || windows=(1 16 64 256 1024)

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/window-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/window.jsonl"
clk_tck=$(getconf CLK_TCK)
# BENCH_WORKER's and BENCH_LIBRDKAFKA's pairs, added to every run's settings.
read -r -d '' -a extra <<<"${BENCH_WORKER:-} ${BENCH_LIBRDKAFKA:-}" || true

# cpu_seconds PID: user + system CPU time of a live process.
cpu_seconds() {
  awk -v t="$clk_tck" '{ print ($14 + $15) / t }' "/proc/$1/stat"
}

echo "| window | partitions | tasks | replies/s (median, min–max) | ideal/s | ratio (median, min–max) | mock max open (median) | worker CPU µs/record (median) | mock CPU µs/record (median) |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for w in "${windows[@]}"; do
  # Ten waves of the window (at least 32 tasks), so the steady state is most of the run.
  tasks=$(( w * 10 < 32 ? 32 : w * 10 ))
  # Every partition may fill the whole window: the window is the subject, and keys hash to
  # partitions unevenly (48 conversations over six partitions put 5 to 13 on one), so a
  # per-partition share of the window would make the busiest partition the limit instead.
  pw=${BENCH_PARTITION_WINDOW:-$w}
  : >"$dir/w$w.runs"
  for run in $(seq 1 "$runs"); do
    id="w${w}p${partitions}r${run}-$$"
    start_mock "$dir/mock-$id" --latency-ms "$latency_ms"
    db_url=$(schema_url "bench_$id")
    topic="bench-$id"
    # A pool of 8: the best of a sweep on 2 cores (docs/BENCHMARKS.md): more sessions take
    # turns on the cores.
    write_settings "$dir/$id.toml" "database.pool_size=${BENCH_POOL_SIZE:-8}" \
      kafka.session_timeout_ms=10000 "worker.worker_id=\"$id\"" "worker.partition_window=$pw" \
      "worker.global_window=$w" worker.drain_timeout_ms=5000 \
      "provider.request_timeout_ms=$(( latency_ms * 4 + 10000 ))" "${extra[@]}"
    "$lab" produce --config "$dir/$id.toml" --create-partitions "$partitions" \
      --count "$tasks" --conversations "$(( partitions * 8 ))" >/dev/null
    "$bin" worker --config "$dir/$id.toml" 2>"$dir/$id.log" &
    worker=$!
    pids+=("$worker")
    deadline=$(( $(date +%s) + 900 ))
    until [ "$(psql -qtA "$db_url" -c "select count(*) from reply_tasks where status = 'completed'" 2>/dev/null || echo 0)" -ge "$tasks" ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: window $w did not finish" >&2; exit 1; }
      sleep 0.5
    done
    cpu=$(cpu_seconds "$worker")
    mock_cpu=$(cpu_seconds "$mock_pid")
    kill -TERM "$worker"; wait "$worker" || true
    max_open=$(curl -s "$mock_url/stats" | sed -n 's/.*"max_in_flight":\([0-9]*\).*/\1/p')
    kill -TERM "$mock_pid"; wait "$mock_pid" || true
    read -r steady_n steady_s whole_s < <(psql -qtA -F ' ' "$db_url" -c "
      with c as (select claimed_at, row_number() over (order by claimed_at) as n from reply_attempts),
           b as (select (select claimed_at from c where n = $w + 1) as a,
                        (select claimed_at from c where n = $tasks - $w + 1) as z,
                        (select min(claimed_at) from c) as first,
                        (select max(finished_at) from reply_attempts) as last)
      select $tasks - 2 * $w, extract(epoch from b.z - b.a), extract(epoch from b.last - b.first) from b")
    awk -v w="$w" -v p="$partitions" -v n="$tasks" -v sn="$steady_n" -v ss="$steady_s" \
        -v ws="$whole_s" -v l="$latency_ms" -v open="${max_open:-0}" -v cpu="$cpu" -v mcpu="$mock_cpu" -v run="$run" 'BEGIN {
      ideal = w / (l / 1000.0)
      # Too few waves for a steady interval (window 1 at a long latency has one call at a time
      # anyway): the whole run.
      rate = (ss > 0.5 && sn > 0) ? sn / ss : n / ws
      printf "%f %f %d %f %f\n", rate, rate / ideal, open, cpu / n * 1e6, mcpu / n * 1e6 > "/dev/stderr"
      printf "{\"bench\":\"window\",\"window\":%d,\"partitions\":%d,\"latency_ms\":%d,\"run\":%d,\"tasks\":%d,\"replies_per_s\":%.1f,\"ideal_per_s\":%.1f,\"ratio\":%.3f,\"whole_run_ratio\":%.3f,\"mock_max_open\":%d,\"worker_cpu_us_per_record\":%.0f,\"mock_cpu_us_per_record\":%.0f}\n",
        w, p, l, run, n, rate, ideal, rate / ideal, n / ws / ideal, open, cpu / n * 1e6, mcpu / n * 1e6
    }' 2>>"$dir/w$w.runs" >>"$jsonl"
  done
  read -r rate_m rate_lo rate_hi < <(cut -d' ' -f1 "$dir/w$w.runs" | stats)
  read -r ratio_m ratio_lo ratio_hi < <(cut -d' ' -f2 "$dir/w$w.runs" | stats)
  read -r open_m _ _ < <(cut -d' ' -f3 "$dir/w$w.runs" | stats)
  read -r cpu_m _ _ < <(cut -d' ' -f4 "$dir/w$w.runs" | stats)
  read -r mcpu_m _ _ < <(cut -d' ' -f5 "$dir/w$w.runs" | stats)
  awk -v w="$w" -v p="$partitions" -v n="$tasks" -v l="$latency_ms" -v rm="$rate_m" -v rl="$rate_lo" \
      -v rh="$rate_hi" -v qm="$ratio_m" -v ql="$ratio_lo" -v qh="$ratio_hi" -v om="$open_m" -v cm="$cpu_m" -v mm="$mcpu_m" 'BEGIN {
    printf "| %d | %d | %d | %.1f (%.1f–%.1f) | %.1f | **%.2f** (%.2f–%.2f) | %d | %.0f | %.0f |\n",
      w, p, n, rm, rl, rh, w / (l / 1000.0), qm, ql, qh, om, cm, mm
  }'
done
