#!/usr/bin/env bash
# Benchmark: replies per second from one worker draining a backlog, SQS Standard (ElasticMQ)
# against Kafka, at equal concurrency (worker.global_window = sqs.max_in_flight = WINDOW), the
# same mock provider (LATENCY_MS a call), the same PostgreSQL, on this machine. Each run loads
# TASKS tasks into a fresh topic (6 partitions) and a fresh queue, then times a worker on each,
# one after the other, from its first completed task to its last; the rate is the tasks after
# the first divided by that. The table gives each run's two rates and their ratio (SQS ÷ Kafka), and the median.
#
# Usage: deploy/bench-sqs.sh [tasks] [window] [latency_ms] [runs]   (default: 3000 64 100 3)
# Writes the table to stdout and one JSON line per run to target/bench/sqs.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tasks=${1:-3000}
window=${2:-64}
latency=${3:-100}
runs=${4:-3}

infra_parts="postgres kafka sqs"
# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
export AWS_ACCESS_KEY_ID=replyd-bench AWS_SECRET_ACCESS_KEY=replyd-bench
dir="$root/target/bench/sqs-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/sqs.jsonl"
partitions=6

# completed_at DB_URL: the count of completed tasks.
completed() {
  psql -qtA "$1" -c "select count(*) from reply_tasks where status = 'completed'" 2>/dev/null || echo 0
}

# drain NAME SETTINGS DB_URL: starts a worker, waits until every task is completed, stops it;
# prints the seconds from the first completion to the last (the steady state: a Kafka
# worker's group join and an SQS worker's first receive are not the source's throughput).
drain() {
  local name=$1 settings=$2 url=$3 worker deadline
  "$bin" worker --config "$settings" 2>"$dir/$name.log" &
  worker=$!
  pids+=("$worker")
  deadline=$(( $(date +%s) + 900 ))
  until [ "$(completed "$url")" -ge "$tasks" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: $name did not finish; see $dir/$name.log" >&2; exit 1; }
    sleep 0.2
  done
  kill -TERM "$worker"
  wait "$worker" || true
  psql -qtA "$url" -c "select round(extract(epoch from max(updated_at) - min(updated_at))::numeric, 2) from reply_tasks"
}

echo "| run | Kafka replies/s | SQS replies/s | SQS ÷ Kafka |"
echo "|---:|---:|---:|---:|"
ratios=()
for run in $(seq 1 "$runs"); do
  id="q${window}r${run}-$$"
  start_mock "$dir/mock-$id" --latency-ms "$latency"
  # Kafka: a topic of its own, loaded before the worker starts.
  topic="bench-$id"
  db_url=$(schema_url "bench_k_$id")
  kafka_url=$db_url
  write_settings "$dir/kafka-$id.toml" "worker.worker_id=\"k$id\"" \
    "worker.partition_window=$window" "worker.global_window=$window" \
    kafka.session_timeout_ms=10000 worker.drain_timeout_ms=5000 provider.request_timeout_ms=10000
  "$bin" migrate --config "$dir/kafka-$id.toml" 2>"$dir/migrate.log"
  "$lab" produce --config "$dir/kafka-$id.toml" --create-partitions "$partitions" \
    --count "$tasks" --conversations "$(( partitions * 8 ))" >/dev/null
  # SQS: a queue of its own, loaded the same way.
  db_url=$(schema_url "bench_s_$id")
  sqs_url=$db_url
  queue=$("$lab" sqs-queue --endpoint "$SQS_ENDPOINT" --name "bench-$id" \
    --tasks "$tasks" --conversations "$(( partitions * 8 ))" | head -n 1)
  write_settings "$dir/sqs-$id.toml" "worker.worker_id=\"s$id\"" \
    "worker.partition_window=$window" "worker.global_window=$window" \
    provider.request_timeout_ms=10000 worker.source='"sqs"' "sqs.queue_url=\"$queue\"" \
    "sqs.endpoint_url=\"$SQS_ENDPOINT\"" sqs.region='"us-east-1"' "sqs.max_in_flight=$window"
  "$bin" migrate --config "$dir/sqs-$id.toml" 2>>"$dir/migrate.log"

  kafka_s=$(drain "kafka-$id" "$dir/kafka-$id.toml" "$kafka_url")
  sqs_s=$(drain "sqs-$id" "$dir/sqs-$id.toml" "$sqs_url")
  kafka_rate=$(awk -v n="$tasks" -v s="$kafka_s" 'BEGIN { printf "%.0f", (n - 1) / s }')
  sqs_rate=$(awk -v n="$tasks" -v s="$sqs_s" 'BEGIN { printf "%.0f", (n - 1) / s }')
  ratio=$(awk -v a="$sqs_rate" -v b="$kafka_rate" 'BEGIN { printf "%.2f", a / b }')
  ratios+=("$ratio")
  echo "| $run | $kafka_rate | $sqs_rate | $ratio |"
  printf '{"run":%d,"tasks":%d,"window":%d,"latency_ms":%d,"kafka_s":%s,"sqs_s":%s,"kafka_per_s":%s,"sqs_per_s":%s,"ratio":%s}\n' \
    "$run" "$tasks" "$window" "$latency" "$kafka_s" "$sqs_s" "$kafka_rate" "$sqs_rate" "$ratio" >>"$jsonl"
  kill -TERM "$mock_pid" 2>/dev/null || true
done
median=$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
echo
echo "median SQS ÷ Kafka: $median ($runs runs of $tasks tasks, window $window, mock $latency ms a call)"
