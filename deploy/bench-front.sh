#!/usr/bin/env bash
# Benchmark P6 (the front half): what the chain adds to the provider's latency, as a user sees
# it. Simulated browsers (`replyd-lab browsers`, no lost answers, no double clicks, no
# regenerates) press Send against `replyd api`, the outbox relay and one worker, with the mock
# at LATENCY ms, and follow each task over Server-Sent Events to "completed". The figure is the
# press-to-completed time (median and 99th percentile), its overhead over the provider's
# latency, and the provider's share of the user's wait (latency ÷ median).
#
# Usage: deploy/bench-front.sh [latency_ms] [presses] [concurrency] [runs]
#        (default: 200 300 16 3)
# Writes the table to stdout and one JSON line per run to target/bench/front.jsonl, and each
# press's time to target/bench/front-latencies.jsonl (the CDF of bench-summary.sh).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
latency_ms=${1:-200}
presses=${2:-300}
concurrency=${3:-16}
runs=${4:-3}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/front-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/front.jsonl"
latencies_jsonl="$root/target/bench/front-latencies.jsonl"

echo "| mock latency | presses | press → completed p50, ms (median, min–max) | p99, ms (median) | overhead at p50, ms (median) | provider's share of the wait (median) |"
echo "|---:|---:|---:|---:|---:|---:|"
: >"$dir/runs"
for run in $(seq 1 "$runs"); do
  id="front-r$run-$$"
  start_mock "$dir/mock-$id" --latency-ms "$latency_ms"
  db_url=$(schema_url "bench_$id")
  schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
  topic="bench-$id"
  # One key presses for every simulated browser here: the per-key limit is not what this runs.
  for name in api relay w1; do
    write_settings "$dir/$id-$name.toml" database.pool_size=8 kafka.session_timeout_ms=10000 \
      "worker.worker_id=\"$id-$name\"" worker.drain_timeout_ms=5000 \
      worker.commit_interval_ms=200 api.rate_limit_per_second=0 relay.poll_interval_ms=500
  done
  "$bin" migrate --config "$dir/$id-api.toml" 2>"$dir/$id-migrate.log"
  "$bin" workspace create bench --config "$dir/$id-api.toml" >/dev/null
  key=$("$bin" api-key create --workspace bench --config "$dir/$id-api.toml" 2>/dev/null)
  "$lab" produce --config "$dir/$id-api.toml" --create-partitions 1 --count 0 >/dev/null
  started=()
  "$bin" api --config "$dir/$id-api.toml" 2>"$dir/$id-api.log" &
  started+=($!)
  "$bin" relay --config "$dir/$id-relay.toml" 2>"$dir/$id-relay.log" &
  started+=($!)
  "$bin" worker --config "$dir/$id-w1.toml" 2>"$dir/$id-w1.log" &
  started+=($!)
  pids+=("${started[@]}")
  wait_until_assigned 60 "$dir/$id-w1.log"
  api=$(api_addr "$dir/$id-api.log")
  REPLYD_API_KEY=$key "$lab" browsers --api "http://$api" --presses "$presses" \
    --concurrency "$concurrency" --lose-share 0 --double-click-share 0 --regenerate-share 0 \
    --press-limit-s 120 --summary --latencies "$dir/$id-latencies.txt" \
    >"$dir/$id-browsers.txt" 2>"$dir/$id-browsers.log"
  line=$(cat "$dir/$id-browsers.txt")
  p50=$(echo "$line" | sed -n 's/.*e2e_ms_p50=\([0-9]*\).*/\1/p')
  p99=$(echo "$line" | sed -n 's/.*e2e_ms_p99=\([0-9]*\).*/\1/p')
  unfinished=$(echo "$line" | sed -n 's/.*unfinished=\([0-9]*\).*/\1/p')
  [ "${unfinished:-1}" -eq 0 ] || { echo "bench: presses did not finish: $line" >&2; exit 1; }
  for pid in "${started[@]}"; do kill -TERM "$pid"; wait "$pid" || true; done
  kill -TERM "$mock_pid"; wait "$mock_pid" || true
  # Where the wait goes, from the database's own clock, each from the task's intake:
  # handed to Kafka (the relay's delivery report), claimed by the worker (the relay, Kafka and
  # the consumer), completed (then the provider and the save). What the user waits beyond
  # "completed" is the notification and the SSE push.
  psql -qAtX "$db_url" -F ' ' -c "
    with s as (
      select extract(epoch from o.published_at - o.created_at) * 1000 as published,
             extract(epoch from a.claimed_at - o.created_at) * 1000 as claimed,
             extract(epoch from t.finished_at - o.created_at) * 1000 as completed
        from outbox o join reply_tasks t using (task_id)
        join reply_attempts a on a.task_id = t.task_id and a.assignment_version = 1)
    select $(for c in published claimed completed; do for q in 0.5 0.99; do
               printf 'round(percentile_cont(%s) within group (order by %s)::numeric, 1),' "$q" "$c"
             done; done | sed 's/,$//')
      from s" >"$dir/$id-stages.txt"
  # The first wave of presses (one per browser) also opens every connection on the way (the
  # pools' sessions, the provider's): its p99 apart from the rest's.
  warm99=$(psql -qAtX "$db_url" -c "
    select round(percentile_cont(0.99) within group (order by ms)::numeric, 1) from (
      select extract(epoch from t.finished_at - o.created_at) * 1000 as ms
        from outbox o join reply_tasks t using (task_id)
       order by o.created_at offset $concurrency) w")
  read -r pub50 pub99 claim50 claim99 done50 done99 <"$dir/$id-stages.txt"
  echo "bench: run $run from intake (p50/p99 ms): published $pub50/$pub99, claimed $claim50/$claim99, completed $done50/$done99, completed after the first wave -/$warm99" >&2
  psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true
  echo "$p50 $p99" >>"$dir/runs"
  printf '{"bench":"front","latency_ms":%d,"presses":%d,"concurrency":%d,"run":%d,"e2e_ms_p50":%d,"e2e_ms_p99":%d,"overhead_ms_p50":%d,"provider_share":%.3f,"from_intake_ms":{"published":[%s,%s],"claimed":[%s,%s],"completed":[%s,%s],"completed_p99_after_first_wave":%s}}\n' \
    "$latency_ms" "$presses" "$concurrency" "$run" "$p50" "$p99" $(( p50 - latency_ms )) \
    "$(awk -v l="$latency_ms" -v p="$p50" 'BEGIN { print l / p }')" \
    "$pub50" "$pub99" "$claim50" "$claim99" "$done50" "$done99" "$warm99" >>"$jsonl"
  printf '{"bench":"front-latencies","invocation":"%s","latency_ms":%d,"run":%d,"e2e_ms":[%s]}\n' \
    "$(basename "$dir")" "$latency_ms" "$run" "$(paste -sd, "$dir/$id-latencies.txt")" >>"$latencies_jsonl"
  echo "bench: run $run: $line" >&2
done
read -r p50_m p50_lo p50_hi < <(cut -d' ' -f1 "$dir/runs" | stats)
read -r p99_m _ _ < <(cut -d' ' -f2 "$dir/runs" | stats)
awk -v l="$latency_ms" -v n="$presses" -v m="$p50_m" -v lo="$p50_lo" -v hi="$p50_hi" -v q="$p99_m" 'BEGIN {
  printf "| %d ms | %d | %d (%d–%d) | %d | %d | **%.2f** |\n", l, n, m, lo, hi, q, m - l, l / m
}'
