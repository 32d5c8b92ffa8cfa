#!/usr/bin/env bash
# Benchmark P5 (failover): three workers share six partitions, the mock at 1 s; once work is
# flowing, one worker is SIGKILLed. Two times, from the kill:
#   - partitions resumed: until the two others hold all six partitions (their
#     replyd_assigned_partitions, polled every 250 ms);
#   - in-flight recovered: until the last task the killed worker had claimed and not finished
#     is completed by another (from the database clock: its finished_at minus the kill).
# Also the generations the run paid per task (the mock's count over the tasks), since a lease
# broken early or a task called again costs a generation.
#
# Usage: deploy/bench-failover.sh [runs] [protocols...]   (default: 3 classic consumer)
#        BENCH_LEASE_MS sets worker.lease_ms (default: the product's, 10000),
#        renewed every fifth of it as the product's default is.
# Classic: kafka.session_timeout_ms = 10000. Consumer (KIP-848): the broker's
# group.consumer.session.timeout.ms (6000 on the cluster of deploy/infra.sh).
# Writes the table to stdout and one JSON line per run to target/bench/failover.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
runs=${1:-3}
shift || true
protocols=("$@")
[ ${#protocols[@]} -gt 0 ] || protocols=(classic consumer)
tasks=3000
lease_ms=${BENCH_LEASE_MS:-10000}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/failover-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/failover.jsonl"

# addr_of LOG: the worker's /metrics address, from its start-up line.
addr_of() { sed -n 's/.*addr=\([0-9.:]*\).*/\1/p' "$1" | head -n 1; }

echo "| protocol | session timeout | lease | partitions resumed, s (median, min–max) | in-flight recovered, s (median, min–max) | tasks in flight at the kill (median) | generations per task (median) |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for protocol in "${protocols[@]}"; do
  case "$protocol" in
    classic) session_ms=10000; session_setting=10000 ;;
    consumer) session_ms=6000; session_setting="" ;;
    *) echo "unknown protocol $protocol" >&2; exit 2 ;;
  esac
  : >"$dir/$protocol.runs"
  for run in $(seq 1 "$runs"); do
    id="f${protocol}r${run}-$$"
    start_mock "$dir/mock-$id" --latency-ms 1000
    db_url=$(schema_url "bench_$id")
    schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
    topic="bench-$id"
    for w in w1 w2 w3; do
      write_settings "$dir/$id-$w.toml" database.pool_size=4 \
        "kafka.group_protocol=\"$protocol\"" "kafka.session_timeout_ms=$session_setting" \
        "worker.worker_id=\"$id-$w\"" worker.partition_window=64 worker.global_window=128 \
        "worker.lease_ms=$lease_ms" "worker.renew_interval_ms=$(( lease_ms / 5 ))" \
        worker.drain_timeout_ms=5000 provider.request_timeout_ms=14000
    done
    "$lab" produce --config "$dir/$id-w1.toml" --create-partitions 6 --count 0 >/dev/null
    declare -A worker_pid=()
    for w in w1 w2 w3; do
      "$bin" worker --config "$dir/$id-$w.toml" 2>"$dir/$id-$w.log" &
      worker_pid[$w]=$!
      pids+=($!)
    done
    wait_until_assigned 90 "$dir/$id-w1.log" "$dir/$id-w2.log" "$dir/$id-w3.log"
    "$lab" produce --config "$dir/$id-w1.toml" --count "$tasks" --conversations 48 >/dev/null
    deadline=$(( $(date +%s) + 120 ))
    until [ "$(terminal_count "$db_url")" -ge 300 ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: work did not start" >&2; exit 1; }
      sleep 0.2
    done

    killed_at=$(psql -qtA "$db_url" -c "select clock_timestamp()")
    wall_kill=$(date +%s.%N)
    kill -KILL "${worker_pid[w1]}"
    survivors=("$(addr_of "$dir/$id-w2.log")" "$(addr_of "$dir/$id-w3.log")")
    deadline=$(( $(date +%s) + 180 ))
    while :; do
      held=0
      for addr in "${survivors[@]}"; do
        n=$(metric "$addr" replyd_assigned_partitions || echo 0)
        held=$(( held + ${n%.*} ))
      done
      [ "$held" -ge 6 ] && break
      [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: the partitions did not move" >&2; exit 1; }
      sleep 0.25
    done
    resumed_s=$(awk -v a="$wall_kill" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')

    # The killed worker's in-flight tasks: claimed by it before the kill, not finished by then.
    inflight_sql="select a.task_id from reply_attempts a where a.worker = '$id-w1' and a.claimed_at <= '$killed_at' and (a.finished_at is null or a.finished_at > '$killed_at')"
    in_flight=$(psql -qtA "$db_url" -c "select count(*) from ($inflight_sql) s")
    until [ "$(psql -qtA "$db_url" -c "select count(*) from reply_tasks where task_id in ($inflight_sql) and status not in ('completed', 'failed')")" -eq 0 ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: in-flight tasks were not recovered" >&2; exit 1; }
      sleep 0.25
    done
    recovered_s=$(psql -qtA "$db_url" -c "select coalesce(round(extract(epoch from max(finished_at) - '$killed_at'::timestamptz)::numeric, 2), 0) from reply_tasks where task_id in ($inflight_sql)")
    until [ "$(terminal_count "$db_url")" -ge "$tasks" ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: the backlog did not drain" >&2; exit 1; }
      sleep 0.5
    done
    generations=$(curl -s "$mock_url/stats" | sed -n 's/.*"generations":\([0-9]*\).*/\1/p')
    for w in w2 w3; do kill -TERM "${worker_pid[$w]}"; wait "${worker_pid[$w]}" || true; done
    wait "${worker_pid[w1]}" 2>/dev/null || true
    kill -TERM "$mock_pid"; wait "$mock_pid" || true
    psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true
    per_task=$(awk -v g="${generations:-0}" -v n="$tasks" 'BEGIN { printf "%.3f", g / n }')
    echo "$resumed_s $recovered_s $in_flight $per_task" >>"$dir/$protocol.runs"
    printf '{"bench":"failover","protocol":"%s","session_timeout_ms":%d,"lease_ms":%d,"run":%d,"partitions_resumed_s":%s,"in_flight_recovered_s":%s,"in_flight_at_kill":%d,"generations_per_task":%s}\n' \
      "$protocol" "$session_ms" "$lease_ms" "$run" "$resumed_s" "$recovered_s" "$in_flight" "$per_task" >>"$jsonl"
    echo "bench: $protocol run $run: resumed ${resumed_s}s, in-flight ($in_flight) recovered ${recovered_s}s, $per_task generations/task" >&2
    unset worker_pid
  done
  read -r res_m res_lo res_hi < <(cut -d' ' -f1 "$dir/$protocol.runs" | stats)
  read -r rec_m rec_lo rec_hi < <(cut -d' ' -f2 "$dir/$protocol.runs" | stats)
  read -r inf_m _ _ < <(cut -d' ' -f3 "$dir/$protocol.runs" | stats)
  read -r gen_m _ _ < <(cut -d' ' -f4 "$dir/$protocol.runs" | stats)
  printf '| %s | %d s | %d s | %s (%s–%s) | %s (%s–%s) | %s | %s |\n' "$protocol" $(( session_ms / 1000 )) \
    $(( lease_ms / 1000 )) "$res_m" "$res_lo" "$res_hi" "$rec_m" "$rec_lo" "$rec_hi" "$inf_m" "$gen_m"
done
