#!/usr/bin/env bash
# make demo: the main job end to end on local, throwaway infrastructure. Starts PostgreSQL and
# Kafka (deploy/infra.sh), the mock provider (~200 ms per reply) and two workers in one group,
# publishes 500 tasks with duplicates and malformed records, shows progress, stops everything,
# and prints one summary line whose figures are read back from PostgreSQL, Kafka and the
# mock's counters by `replyd check`.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

tasks=${DEMO_TASKS:-500}
duplicates=${DEMO_DUPLICATES:-100}
malformed=${DEMO_MALFORMED:-8}
partitions=${DEMO_PARTITIONS:-6}
limit_s=${DEMO_LIMIT_S:-600}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
echo "demo: starting infrastructure, building replyd (release)" >&2
prepare

run_id="$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/demo/$run_id"
mkdir -p "$dir"
topic="demo-$run_id"
group="demo-$run_id"
db_url=$(schema_url "demo_$run_id")
start_mock "$dir/mock" --latency-ms 200 --latency-jitter-ms 50

for w in w1 w2; do
  cat >"$dir/$w.toml" <<TOML
[database]
url = "$db_url"
[kafka]
bootstrap_servers = "$KAFKA_BOOTSTRAP"
topic = "$topic"
group_id = "$group"
session_timeout_ms = 10000
[worker]
worker_id = "$w"
partition_window = 32
global_window = 128
lease_ms = 15000
renew_interval_ms = 5000
drain_timeout_ms = 5000
commit_interval_ms = 500
[provider]
base_url = "$mock_url"
request_timeout_ms = 30000
[observability]
listen = "127.0.0.1:0"
TOML
done
# The operator commands (produce, check) read the same settings as the workers.
"$bin" produce --config "$dir/w1.toml" --create-partitions "$partitions" --count 0 >/dev/null
for w in w1 w2; do
  "$bin" worker --config "$dir/$w.toml" 2>"$dir/$w.log" &
  pids+=($!)
done
# Publish only once every worker holds partitions, so the demo shows two workers sharing
# the work, not one doing all of it while the other is still joining.
wait_until_assigned 60 "$dir/w1.log" "$dir/w2.log" || { tail -n 5 "$dir"/w*.log >&2; exit 1; }
echo "demo: both workers hold partitions" >&2

start=$(date +%s.%N)
produced=$("$bin" produce --config "$dir/w1.toml" --count "$tasks" \
  --duplicates "$duplicates" --malformed "$malformed" --ids-file "$dir/task-ids")
echo "demo: published $produced" >&2

deadline=$(( $(date +%s) + limit_s ))
while :; do
  done_count=$(terminal_count "$db_url")
  rate=$(awk -v n="$done_count" -v s="$start" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", n / (now - s) }')
  printf 'demo: %s/%s tasks terminal, %s replies/s\n' "$done_count" "$tasks" "$rate" >&2
  [ "$done_count" -ge "$tasks" ] && break
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "demo: a process exited early; logs in $dir" >&2; tail -n 5 "$dir"/*.log >&2; exit 1; }
  done
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "demo: not finished within ${limit_s}s; see $dir" >&2
    exit 1
  fi
  sleep 2
done
elapsed=$(awk -v s="$start" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", now - s }')

# Stop the workers through their drain path (SIGTERM: drain, commit, leave), then read back.
for pid in "${pids[@]:1}"; do kill -TERM "$pid"; done
for pid in "${pids[@]:1}"; do wait "$pid" || true; done
pids=("${pids[0]}")

summary=$("$bin" check --config "$dir/w1.toml" --mock-url "$mock_url" --summary) || {
  echo "demo: an invariant is broken:" >&2
  "$bin" check --config "$dir/w1.toml" --mock-url "$mock_url" >&2 || true
  exit 1
}
"$bin" check --config "$dir/w1.toml" --mock-url "$mock_url" >"$dir/check.txt" || true
echo "demo: logs in $dir" >&2
echo "demo: $summary elapsed_s=$elapsed"
