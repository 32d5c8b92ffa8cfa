#!/usr/bin/env bash
# Benchmark: throughput of one worker on ONE partition against the mock provider at a fixed
# latency, for several in-flight windows, next to the ideal (window / latency). Figures come
# from the database clock: tasks / (last completion - first claim), so start-up and group join
# are not counted. Prints a Markdown table. Usage:
#   deploy/bench-window.sh [latency_ms] [windows...]      (default: 500 1 16 64 256)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
latency_ms=${1:-500}
shift || true
windows=("$@")
[ ${#windows[@]} -gt 0 ] || windows=(1 16 64 256)

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/window-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
start_mock "$dir/mock" --latency-ms "$latency_ms"

echo "| window | tasks | seconds | replies/s | ideal/s (window / latency) | ratio |"
echo "|---:|---:|---:|---:|---:|---:|"
for w in "${windows[@]}"; do
  tasks=$(( w * 6 < 24 ? 24 : w * 6 ))
  id="w${w}-$$"
  db_url=$(schema_url "bench_$id")
  topic="bench-$id"
  cat >"$dir/$id.toml" <<TOML
[database]
url = "$db_url"
pool_size = 32
[kafka]
bootstrap_servers = "$KAFKA_BOOTSTRAP"
topic = "$topic"
group_id = "bench-$id"
session_timeout_ms = 10000
${BENCH_LIBRDKAFKA:-}
[worker]
worker_id = "$id"
partition_window = $w
global_window = $w
lease_ms = 30000
renew_interval_ms = 10000
drain_timeout_ms = 5000
${BENCH_WORKER:-}
[provider]
base_url = "$mock_url"
[observability]
listen = "127.0.0.1:0"
TOML
  "$bin" produce --config "$dir/$id.toml" --create-partitions 1 \
    --count "$tasks" --conversations 1 >/dev/null
  "$bin" worker --config "$dir/$id.toml" 2>"$dir/$id.log" &
  worker=$!
  pids+=($worker)
  deadline=$(( $(date +%s) + 600 ))
  until [ "$(psql -qtA "$db_url" -c "select count(*) from reply_tasks where status = 'completed'" 2>/dev/null || echo 0)" -ge "$tasks" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: window $w did not finish" >&2; exit 1; }
    sleep 0.5
  done
  kill -TERM "$worker"; wait "$worker" || true
  seconds=$(psql -qtA "$db_url" -c "select extract(epoch from max(finished_at) - min(claimed_at)) from reply_attempts")
  awk -v w="$w" -v n="$tasks" -v s="$seconds" -v l="$latency_ms" 'BEGIN {
    rate = n / s; ideal = w / (l / 1000.0)
    printf "| %d | %d | %.2f | %.1f | %.1f | %.2f |\n", w, n, s, rate, ideal, rate / ideal
  }'
done
