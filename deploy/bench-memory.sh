#!/usr/bin/env bash
# Benchmark P4 (memory): one worker at window 1,024 on six partitions, mock at 1 s, in front of
# a backlog of 10,000, 100,000 and 1,000,000 records. Each run works for SECONDS and samples
# the worker's resident set every second; the figure is the peak (VmHWM, the kernel's
# high-water mark) against the 100 MiB goal, and it should not grow with the backlog: the
# worker holds only its windows and read-ahead, never the backlog.
#
# Usage: deploy/bench-memory.sh [seconds] [runs] [backlogs...]
#        (default: 45 3 10000 100000 1000000)
# Writes the table to stdout and one JSON line per run to target/bench/memory.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${1:-45}
runs=${2:-3}
shift 2 || true
backlogs=("$@")
[ ${#backlogs[@]} -gt 0 ] || backlogs=(10000 100000 1000000)
window=1024
partitions=6
goal_kib=$(( 100 * 1024 ))

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/memory-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/memory.jsonl"

echo "| backlog | replies in ${seconds} s (median) | RSS at the end, MiB (median) | peak RSS, MiB (median, min–max) | peak ÷ 100 MiB (median) |"
echo "|---:|---:|---:|---:|---:|"
for backlog in "${backlogs[@]}"; do
  : >"$dir/b$backlog.runs"
  for run in $(seq 1 "$runs"); do
    id="m${backlog}r${run}-$$"
    start_mock "$dir/mock-$id" --latency-ms 1000
    db_url=$(schema_url "bench_$id")
    schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
    topic="bench-$id"
    write_settings "$dir/$id.toml" "database.pool_size=${BENCH_POOL_SIZE:-8}" \
      kafka.session_timeout_ms=10000 "worker.worker_id=\"$id\"" \
      "worker.partition_window=$window" "worker.global_window=$window" \
      worker.drain_timeout_ms=5000 provider.request_timeout_ms=14000
    "$lab" produce --config "$dir/$id.toml" --create-partitions "$partitions" \
      --count "$backlog" --conversations 480 >/dev/null
    "$bin" worker --config "$dir/$id.toml" 2>"$dir/$id.log" &
    worker=$!
    pids+=("$worker")
    : >"$dir/$id.rss"
    for _ in $(seq 1 "$seconds"); do
      sed -n 's/^VmRSS:\s*\([0-9]*\) kB/\1/p' "/proc/$worker/status" >>"$dir/$id.rss"
      sleep 1
    done
    peak=$(sed -n 's/^VmHWM:\s*\([0-9]*\) kB/\1/p' "/proc/$worker/status")
    last=$(tail -n 1 "$dir/$id.rss")
    done_n=$(psql -qtA "$db_url" -c "select count(*) from reply_tasks where status = 'completed'")
    kill -TERM "$worker"; wait "$worker" || true
    kill -TERM "$mock_pid"; wait "$mock_pid" || true
    psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true
    echo "$peak $last $done_n" >>"$dir/b$backlog.runs"
    printf '{"bench":"memory","backlog":%d,"window":%d,"partitions":%d,"run":%d,"seconds":%d,"replies":%d,"rss_end_kib":%d,"peak_rss_kib":%d,"peak_over_goal":%.3f}\n' \
      "$backlog" "$window" "$partitions" "$run" "$seconds" "$done_n" "$last" "$peak" \
      "$(awk -v p="$peak" -v g="$goal_kib" 'BEGIN { print p / g }')" >>"$jsonl"
  done
  read -r peak_m peak_lo peak_hi < <(cut -d' ' -f1 "$dir/b$backlog.runs" | stats)
  read -r last_m _ _ < <(cut -d' ' -f2 "$dir/b$backlog.runs" | stats)
  read -r done_m _ _ < <(cut -d' ' -f3 "$dir/b$backlog.runs" | stats)
  awk -v b="$backlog" -v d="$done_m" -v l="$last_m" -v pm="$peak_m" -v pl="$peak_lo" -v ph="$peak_hi" -v g="$goal_kib" 'BEGIN {
    printf "| %d | %d | %.0f | %.0f (%.0f–%.0f) | **%.2f** |\n", b, d, l / 1024, pm / 1024, pl / 1024, ph / 1024, pm / g
  }'
done
