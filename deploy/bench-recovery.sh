#!/usr/bin/env bash
# Benchmark: provider calls and generations per completed task when a share of calls end
# ambiguously ("work done, connection dropped"), with recovery by Idempotency-Key (the mock
# honours the key), by operation id (background responses: the id is stored before waiting),
# and with no recovery (the mock ignores the key; the worker's ambiguous policy is "retry").
# Calls are chat requests plus background creates (polls are not counted). Figures come from
# the mock's counters and PostgreSQL. Prints a Markdown table. Usage:
#   deploy/bench-recovery.sh [tasks] [drop_rate]      (default: 1000 0.2)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tasks=${1:-1000}
drop_rate=${2:-0.2}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/recovery-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"

echo "| recovery | tasks | completed | failed | calls | generations | calls/completed | generations/completed |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
for mode in idempotency-key operation-id none; do
  honour=$([ "$mode" = none ] && echo false || echo true)
  api=$([ "$mode" = operation-id ] && echo background_responses || echo chat_completions)
  id="rec-$mode-$$"
  start_mock "$dir/$id-mock" --latency-ms 50 --drop-after-work-rate "$drop_rate" \
    --honour-idempotency-key "$honour" --seed 7
  mock=$mock_pid
  db_url=$(schema_url "bench_$id")
  topic="bench-$id"
  write_settings "$dir/$id.toml" database.pool_size=32 kafka.session_timeout_ms=10000 \
    "worker.worker_id=\"$id\"" worker.partition_window=32 worker.global_window=128 \
    worker.drain_timeout_ms=5000 provider.request_timeout_ms=10000 "provider.api=\"$api\"" \
    provider.poll_interval_ms=50 retry.base_delay_ms=50 retry.max_delay_ms=1000 \
    'retry.ambiguous="retry"' "retry.provider_honours_idempotency_key=$honour"
  "$lab" produce --config "$dir/$id.toml" --create-partitions 4 \
    --count "$tasks" --max-attempts 5 >/dev/null
  "$bin" worker --config "$dir/$id.toml" 2>"$dir/$id.log" &
  worker=$!
  pids+=($worker)
  deadline=$(( $(date +%s) + 900 ))
  until [ "$(terminal_count "$db_url")" -ge "$tasks" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: recovery $mode did not finish" >&2; exit 1; }
    sleep 1
  done
  kill -TERM "$worker"; wait "$worker" || true
  read -r completed failed < <(psql -qtA -F ' ' "$db_url" -c \
    "select count(*) filter (where status = 'completed'), count(*) filter (where status = 'failed') from reply_tasks")
  stats=$(curl -s "$mock_url/stats" 2>/dev/null || true)
  if [ -z "$stats" ]; then
    stats=$(exec 3<>"/dev/tcp/${mock_url#http://}" && printf 'GET /stats HTTP/1.0\r\n\r\n' >&3 && cat <&3 | tail -n 1)
    stats=$(echo "$stats" | tr -d '\r')
  fi
  requests=$(echo "$stats" | sed -n 's/.*"requests":\([0-9]*\).*/\1/p')
  creates=$(echo "$stats" | sed -n 's/.*"responses_created":\([0-9]*\).*/\1/p')
  calls=$(( requests + ${creates:-0} ))
  generations=$(echo "$stats" | sed -n 's/.*"generations":\([0-9]*\).*/\1/p')
  kill -TERM "$mock"; wait "$mock" || true
  awk -v m="$mode" -v n="$tasks" -v c="$completed" -v f="$failed" -v k="$calls" -v g="$generations" 'BEGIN {
    printf "| %s | %d | %d | %d | %d | %d | %.3f | %.3f |\n", m, n, c, f, k, g, k / c, g / c
  }'
done
