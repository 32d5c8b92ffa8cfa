#!/usr/bin/env bash
# Benchmark P3: the worker's own cost per record, outside PostgreSQL and the provider, three
# ways in one run. One worker (window 256, six partitions) drains a backlog against a
# zero-latency mock; each drain has its own schema, topic and mock.
#   1. Instructions per record, stable on a noisy machine: the worker under valgrind's
#      callgrind drains SMALL records, then LARGE; (Ir(LARGE) − Ir(SMALL)) ÷ (LARGE − SMALL)
#      takes start-up, connection set-up and shutdown out.
#   2. Process CPU time per record (utime + stime from /proc), the same difference, RUNS times.
#   3. A flame graph of a worker draining PERF records (perf, 499 Hz, DWARF call stacks):
#      docs/bench/p3-flamegraph.svg, drawn by inferno (built once per machine from crates.io
#      into the cache).
#
# Usage: deploy/bench-profile.sh [small] [large] [runs] [perf]   (default: 1000 5000 3 20000)
# BENCH_CPU_ONLY=1 runs only 2 (minutes instead of a quarter of an hour: to compare builds);
# BENCH_INSTRUCTIONS_ONLY=1 runs only 1 (a minute or two: the stable figure, to compare builds).
# Writes the table to stdout and one JSON line to target/bench/profile.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
small=${1:-1000}
large=${2:-5000}
runs=${3:-3}
perf_records=${4:-20000}
inferno_version=0.12.8

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
if ! command -v valgrind >/dev/null || ! command -v perf >/dev/null; then
  echo "bench: installing valgrind and linux-perf" >&2
  sudo_=""
  [ "$(id -u)" -eq 0 ] || sudo_=sudo
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind linux-perf >/dev/null
fi
cache="${REPLYD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/replyd}"
inferno="$cache/inferno-$inferno_version/bin"
if [ ! -x "$inferno/inferno-flamegraph" ]; then
  echo "bench: building inferno $inferno_version once (a minute or two)" >&2
  cargo install --quiet --locked --root "$cache/inferno-$inferno_version" inferno --version "$inferno_version"
fi
dir="$root/target/bench/profile-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/profile.jsonl"
clk_tck=$(getconf CLK_TCK)

# drain NAME RECORDS WRAPPER...: one worker drains RECORDS records, started under WRAPPER (none
# for a plain run); prints its CPU seconds. Callgrind and perf write their files on its exit.
drain() {
  local name=$1 records=$2
  shift 2
  local id="$name-$$" db_url schema topic worker cpu deadline
  start_mock "$dir/mock-$id" --latency-ms 0
  db_url=$(schema_url "bench_$id")
  schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
  topic="bench-$id"
  # The session timeout is generous: under valgrind every thread runs many times slower,
  # heartbeats included.
  write_settings "$dir/$id.toml" database.pool_size=8 kafka.session_timeout_ms=45000 \
    "worker.worker_id=\"$id\"" worker.partition_window=256 worker.global_window=256 \
    worker.drain_timeout_ms=30000 provider.request_timeout_ms=60000
  "$lab" produce --config "$dir/$id.toml" --create-partitions 6 --count "$records" \
    --conversations 48 >/dev/null
  "$@" "$bin" worker --config "$dir/$id.toml" 2>"$dir/$id.log" &
  worker=$!
  pids+=("$worker")
  deadline=$(( $(date +%s) + 1200 ))
  until [ "$(psql -qtA "$db_url" -c "select count(*) from reply_tasks where status = 'completed'" 2>/dev/null || echo 0)" -ge "$records" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: $name did not drain; see $dir/$id.log" >&2; exit 1; }
    sleep 0.5
  done
  # Under a wrapper the pid is the wrapper's (valgrind runs the program in its own process).
  cpu=$(awk -v t="$clk_tck" '{ print ($14 + $15) / t }' "/proc/$worker/stat")
  kill -TERM "$worker"
  wait "$worker" || true
  kill -TERM "$mock_pid"; wait "$mock_pid" || true
  psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true
  echo "$cpu"
}

# 1. Instructions: callgrind's total over the worker's life, for both backlogs.
ir_of() {
  sed -n 's/^summary: *\([0-9]*\).*/\1/p; s/^totals: *\([0-9]*\).*/\1/p' "$1" | head -n 1
}
cpu_only=${BENCH_CPU_ONLY:-}
instructions_only=${BENCH_INSTRUCTIONS_ONLY:-}
[ -z "$instructions_only" ] || runs=0
ir_per_record=null
if [ -z "$cpu_only" ]; then
  echo "bench: callgrind, $small then $large records (each takes minutes)" >&2
  drain "cg-small" "$small" valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.small" >/dev/null
  drain "cg-large" "$large" valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.large" >/dev/null
  ir_small=$(ir_of "$dir/callgrind.small")
  ir_large=$(ir_of "$dir/callgrind.large")
  ir_per_record=$(awk -v a="$ir_small" -v b="$ir_large" -v s="$small" -v l="$large" 'BEGIN { printf "%.0f", (b - a) / (l - s) }')
  echo "bench: instructions: $ir_small over $small records, $ir_large over $large: $ir_per_record per record" >&2
fi

# 2. CPU time, the same difference, RUNS times.
: >"$dir/cpu"
for run in $(seq 1 "$runs"); do
  a=$(drain "cpu-small-r$run" "$small")
  b=$(drain "cpu-large-r$run" "$large")
  awk -v a="$a" -v b="$b" -v s="$small" -v l="$large" 'BEGIN { printf "%.1f\n", (b - a) / (l - s) * 1e6 }' >>"$dir/cpu"
  echo "bench: run $run: CPU $a s over $small records, $b s over $large: $(tail -n 1 "$dir/cpu") µs per record" >&2
done
cpu_m=null cpu_lo=null cpu_hi=null
[ "$runs" -eq 0 ] || read -r cpu_m cpu_lo cpu_hi < <(stats <"$dir/cpu")

# 3. The flame graph.
if [ -z "$cpu_only" ] && [ -z "$instructions_only" ]; then
  drain "perf" "$perf_records" perf record -q -F 499 --call-graph dwarf,16384 -o "$dir/perf.data" >/dev/null
  perf script -i "$dir/perf.data" 2>/dev/null | "$inferno/inferno-collapse-perf" >"$dir/stacks.folded"
  mkdir -p docs/bench
  "$inferno/inferno-flamegraph" --title "replyd worker, zero-latency provider, $perf_records records (perf, 499 Hz)" \
    --minwidth 0.2 <"$dir/stacks.folded" >docs/bench/p3-flamegraph.svg
  # perf's cpu-clock samples weigh their period, in nanoseconds.
  sampled_s=$(awk '{ n += $NF } END { printf "%.1f", n / 1e9 }' "$dir/stacks.folded")
  echo "bench: wrote docs/bench/p3-flamegraph.svg ($sampled_s s of CPU sampled, $(wc -l <"$dir/stacks.folded") distinct stacks)" >&2
fi

printf '{"bench":"profile","small":%d,"large":%d,"instructions_per_record":%s,"cpu_us_per_record":{"median":%s,"min":%s,"max":%s},"goal_us":50}\n' \
  "$small" "$large" "$ir_per_record" "$cpu_m" "$cpu_lo" "$cpu_hi" >>"$jsonl"
echo "| records (small → large) | instructions per record | worker CPU per record, µs (median, min–max) | ÷ goal of 50 µs |"
echo "|---|---:|---:|---:|"
awk -v s="$small" -v l="$large" -v ir="$ir_per_record" -v m="$cpu_m" -v lo="$cpu_lo" -v hi="$cpu_hi" 'BEGIN {
  cpu = (m == "null" ? "not run" : sprintf("%.0f (%.0f–%.0f)", m, lo, hi))
  goal = (m == "null" ? "" : sprintf("**%.1f**", m / 50))
  printf "| %d → %d | %s | %s | %s |\n", s, l, (ir == "null" ? "not run" : ir), cpu, goal
}'
