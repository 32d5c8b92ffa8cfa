#!/usr/bin/env bash
# make demo: the whole chain end to end on local, throwaway infrastructure. Starts PostgreSQL
# and Kafka (deploy/infra.sh), the mock provider (~200 ms per reply), and as separate
# processes the API, the outbox relay and two workers in one group. Then simulated browsers
# press Send over HTTP: each press has its own Idempotency-Key, some lose their first answer
# on purpose (a client timeout) and retry with the same key, some double-click, some press
# Regenerate, and every one follows its reply over Server-Sent Events to completion. A few
# malformed records go straight to the topic, as a broken producer would send them. At the
# end every process is stopped through its drain path and one summary line is printed: what
# the browsers did and saw (`replyd-lab browsers`) and what the durable state says (`replyd check`).
# A product's own server (`replyd-lab product`) serves the demo page on its origin, signing a
# person in with a short-lived end-user token (the workspace's key stays on it): DEMO_PAGE_S=300
# keeps the chain up five minutes after the simulated browsers, to press Send at the URL it prints.
# DEMO_SOURCE=sqs runs the chain on an SQS Standard queue instead of Kafka (ElasticMQ, started by
# deploy/infra.sh): the relay sends to the queue, the workers receive from it, and the malformed
# messages go to it; Kafka is not started.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

presses=${DEMO_PRESSES:-1000}
concurrency=${DEMO_CONCURRENCY:-32}
malformed=${DEMO_MALFORMED:-8}
partitions=${DEMO_PARTITIONS:-6}
limit_s=${DEMO_LIMIT_S:-600}
# Seconds the chain stays up after the simulated browsers, for a person to try the demo page.
page_s=${DEMO_PAGE_S:-0}
source=${DEMO_SOURCE:-kafka}
case "$source" in
  kafka) infra_parts="postgres kafka" ;;
  sqs) infra_parts="postgres sqs" ;;
  *) echo "demo: DEMO_SOURCE=$source: use kafka or sqs" >&2; exit 2 ;;
esac

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
echo "demo: starting infrastructure, building replyd (release)" >&2
prepare

run_id="$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/demo/$run_id"
mkdir -p "$dir"
topic="demo-$run_id"
db_url=$(schema_url "demo_$run_id")
start_mock "$dir/mock" --latency-ms 200 --latency-jitter-ms 50

# The product's own server (`replyd-lab product`) serves the demo page on its origin and alone
# holds the workspace's key; the page calls the API on another origin, which must allow it. A
# port nothing answers on, for that origin.
product_port=18480
while (exec 3<>"/dev/tcp/127.0.0.1/$product_port") 2>/dev/null; do
  product_port=$((product_port + 1))
done
product="http://127.0.0.1:$product_port"

# On SQS: the queue and its dead-letter queue (after 10 receives), and its settings. The AWS
# SDK signs every call; the local server checks no credentials.
transport=()
if [ "$source" = sqs ]; then
  queues=$("$lab" sqs-queue --endpoint "$SQS_ENDPOINT" --name "$topic" --malformed "$malformed")
  queue_url=$(echo "$queues" | head -n 1)
  transport=(worker.source='"sqs"' relay.sink='"sqs"' "sqs.queue_url=\"$queue_url\"" \
    "sqs.endpoint_url=\"$SQS_ENDPOINT\"" sqs.region='"us-east-1"' kafka.bootstrap_servers=)
  export AWS_ACCESS_KEY_ID=replyd-demo AWS_SECRET_ACCESS_KEY=replyd-demo
fi

# One settings file per process (only the worker id differs): the same configuration runs
# every part. One key presses for every simulated browser here: the per-key limit is not what
# this runs.
# The key the API seals its end users' token signing secrets with (api.end_user_token_key).
token_key=$(head -c 32 /dev/urandom | base64)
for name in api w1 w2; do
  write_settings "$dir/$name.toml" "worker.worker_id=\"$name\"" "${transport[@]}" \
    "api.end_user_token_key=\"$token_key\"" \
    kafka.session_timeout_ms=10000 worker.partition_window=32 worker.global_window=128 \
    worker.lease_ms=15000 worker.renew_interval_ms=5000 worker.drain_timeout_ms=5000 \
    worker.commit_interval_ms=500 provider.request_timeout_ms=30000 \
    api.rate_limit_per_second=0 "api.cors_allowed_origins=[\"$product\"]" \
    relay.poll_interval_ms=500
done
start_front_half "$dir/api.toml" demo "$dir"
for w in w1 w2; do
  "$bin" worker --config "$dir/$w.toml" 2>"$dir/$w.log" &
  pids+=($!)
done
# Press Send only once every worker holds partitions (or receives from the queue), so the demo
# shows two workers sharing the work, not one doing all of it while the other is still joining.
if [ "$source" = kafka ]; then
  wait_until_assigned 60 "$dir/w1.log" "$dir/w2.log" || { tail -n 5 "$dir"/*.log >&2; exit 1; }
else
  for w in w1 w2; do
    for _ in $(seq 1 120); do grep -q "SQS source started" "$dir/$w.log" 2>/dev/null && break; sleep 0.5; done
  done
fi
REPLYD_API_KEY=$key "$lab" product --api "http://$api" --listen "127.0.0.1:$product_port" \
  2>"$dir/product.log" &
pids+=($!)
echo "demo: API on $api, relay and two workers running on $source; $presses browsers pressing Send" >&2
echo "demo: the demo page is $product/demo: sign in with any name (DEMO_PAGE_S=N keeps the chain up N s after the browsers)" >&2

if [ "$source" = kafka ]; then
  "$lab" produce --config "$dir/api.toml" --count 0 --malformed "$malformed" >/dev/null
fi

start=$(date +%s.%N)
REPLYD_API_KEY=$key timeout "$limit_s" "$lab" browsers --api "http://$api" \
  --presses "$presses" --concurrency "$concurrency" --press-limit-s "$limit_s" \
  --summary >"$dir/browsers.txt" 2>"$dir/browsers.log" &
browsers=$!
while kill -0 "$browsers" 2>/dev/null; do
  done_count=$(terminal_count "$db_url")
  printf 'demo: %s tasks terminal\n' "$done_count" >&2
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || { echo "demo: a process exited early; logs in $dir" >&2; tail -n 5 "$dir"/*.log >&2; exit 1; }
  done
  sleep 2
done
wait "$browsers" || { echo "demo: the browsers did not finish; see $dir/browsers.log" >&2; exit 1; }
elapsed=$(awk -v s="$start" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", now - s }')
if [ "$page_s" -gt 0 ]; then
  echo "demo: the chain stays up $page_s s for the page: $product/demo" >&2
  sleep "$page_s"
fi

# Let the relay and the workers finish what remains (the malformed records' dead letters, the
# last commits), then stop every part through its drain path (SIGTERM) and read back.
sleep 2
for pid in "${pids[@]:1}"; do kill -TERM "$pid"; done
for pid in "${pids[@]:1}"; do wait "$pid" || true; done
pids=("${pids[0]}")

summary=$("$bin" check --config "$dir/api.toml" --mock-url "$mock_url" --summary) || {
  echo "demo: an invariant is broken:" >&2
  "$bin" check --config "$dir/api.toml" --mock-url "$mock_url" >&2 || true
  exit 1
}
"$bin" check --config "$dir/api.toml" --mock-url "$mock_url" >"$dir/check.txt" || true
browsers_summary=$(cat "$dir/browsers.txt")
echo "demo: logs in $dir" >&2
echo "demo: $browsers_summary $summary elapsed_s=$elapsed"
for want in answers_disagreeing=0 unfinished=0; do
  case " $browsers_summary " in
    *" $want "*) ;;
    *) echo "demo: the browsers saw a problem: $want expected" >&2; exit 1 ;;
  esac
done
