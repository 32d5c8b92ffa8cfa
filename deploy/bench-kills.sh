#!/usr/bin/env bash
# Benchmark: a worker SIGKILLed mid-backlog and started again at once, as a pod is, several
# times. Two workers (window 32 each: 64 calls at once) share 4 partitions; the mock takes
# 500 ms a call and, like the hosted APIs, finishes (and bills) the work of a client that went
# away. Once a quarter, a half and three quarters of the tasks are done, w1 is SIGKILLed and
# started again with the same worker_id and (with BENCH_STATIC=true, the default) the same
# kafka.group_instance_id, so the group hands it its partitions back without a rebalance.
#
# Reported per run, from the database clock and the mock's counters:
#   - last reply: from the first claim to the last task's finished_at; the ideal is
#     tasks × 500 ms ÷ 64;
#   - generations per task: the mock's generations over the tasks (a call in flight at a kill
#     has been paid for, whatever happens next);
#   - second replies and the other invariants: `replyd check` (its exit status).
#
# Usage: deploy/bench-kills.sh [tasks] [kills] [runs]     (default: 1000 3 1)
#        BENCH_STATIC=false starts w1 again without static membership (the group rebalances;
#        the survivor or the new w1 takes the dead incarnation's tasks).
# Writes the table to stdout and one JSON line per run to target/bench/kills.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tasks=${1:-1000}
kills=${2:-3}
runs=${3:-1}
static=${BENCH_STATIC:-true}
latency_ms=500
window=32

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/kills-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/kills.jsonl"
version=$(basename "$(dirname "$bin")")  # the folder the binary was built into or copied to

echo "| binary | static membership | run | last reply, s | ideal, s | last ÷ ideal | generations per task | check |"
echo "|---|---|---:|---:|---:|---:|---:|---|"
for run in $(seq 1 "$runs"); do
  id="k${run}-$$"
  start_mock "$dir/mock-$id" --latency-ms "$latency_ms"
  db_url=$(schema_url "bench_$id")
  schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
  topic="bench-$id"
  for w in w1 w2; do
    instance=$([ "$static" = true ] && echo "\"$id-$w\"" || echo "")
    write_settings "$dir/$id-$w.toml" database.pool_size=8 kafka.session_timeout_ms=10000 \
      "kafka.group_instance_id=$instance" "worker.worker_id=\"$id-$w\"" \
      "worker.partition_window=$window" "worker.global_window=$window" \
      worker.drain_timeout_ms=5000 provider.request_timeout_ms=10000
  done
  "$lab" produce --config "$dir/$id-w1.toml" --create-partitions 4 --count 0 >/dev/null
  "$bin" migrate --config "$dir/$id-w1.toml" 2>"$dir/$id-migrate.log"
  declare -A worker_pid=()
  start_worker() {
    "$bin" worker --config "$dir/$id-$1.toml" 2>>"$dir/$id-$1.log" &
    worker_pid[$1]=$!
    pids+=($!)
  }
  start_worker w1
  start_worker w2
  wait_until_assigned 90 "$dir/$id-w1.log" "$dir/$id-w2.log"
  "$lab" produce --config "$dir/$id-w1.toml" --count "$tasks" --conversations 64 >/dev/null
  deadline=$(( $(date +%s) + 300 ))
  for k in $(seq 1 "$kills"); do
    mark=$(( tasks * k / (kills + 1) ))
    until [ "$(terminal_count "$db_url")" -ge "$mark" ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: stuck before kill $k" >&2; exit 1; }
      sleep 0.1
    done
    kill -KILL "${worker_pid[w1]}"
    wait "${worker_pid[w1]}" 2>/dev/null || true
    echo "bench: run $run: kill $k at $mark done" >&2
    start_worker w1
  done
  until [ "$(terminal_count "$db_url")" -ge "$tasks" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: the backlog did not drain" >&2; exit 1; }
    sleep 0.2
  done
  last_s=$(psql -qtA "$db_url" -c "select round(extract(epoch from (select max(finished_at) from reply_tasks) - (select min(claimed_at) from reply_attempts))::numeric, 2)")
  generations=$(curl -s "$mock_url/stats" | sed -n 's/.*"generations":\([0-9]*\).*/\1/p')
  for w in w1 w2; do kill -TERM "${worker_pid[$w]}" 2>/dev/null || true; wait "${worker_pid[$w]}" 2>/dev/null || true; done
  check=ok
  "$bin" check --config "$dir/$id-w2.toml" >"$dir/$id-check.txt" 2>&1 || check=failed
  kill -TERM "$mock_pid"; wait "$mock_pid" || true
  psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true
  ideal=$(awk -v n="$tasks" -v l="$latency_ms" -v w="$window" 'BEGIN { printf "%.2f", n * l / 1000 / (2 * w) }')
  ratio=$(awk -v a="$last_s" -v b="$ideal" 'BEGIN { printf "%.2f", a / b }')
  per_task=$(awk -v g="${generations:-0}" -v n="$tasks" 'BEGIN { printf "%.3f", g / n }')
  printf '| %s | %s | %d | %s | %s | %s | %s | %s |\n' "$version" "$static" "$run" "$last_s" "$ideal" "$ratio" "$per_task" "$check"
  printf '{"bench":"kills","binary":"%s","static":%s,"run":%d,"tasks":%d,"kills":%d,"last_reply_s":%s,"ideal_s":%s,"generations_per_task":%s,"check":"%s"}\n' \
    "$version" "$static" "$run" "$tasks" "$kills" "$last_s" "$ideal" "$per_task" "$check" >>"$jsonl"
  unset worker_pid
done
