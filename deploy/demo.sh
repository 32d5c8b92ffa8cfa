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

bash deploy/infra.sh up >/dev/null
if ! command -v psql >/dev/null; then
  echo "demo: installing postgresql-client (psql, for progress)" >&2
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_=sudo
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-client >/dev/null
fi
# shellcheck disable=SC1091
set -a && . target/infra/env && set +a

echo "demo: building replyd (release)" >&2
cargo build --release --quiet
bin="$root/target/release/replyd"

run_id="$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/demo/$run_id"
mkdir -p "$dir"
topic="demo-$run_id"
group="demo-$run_id"
schema="demo_$(echo "$run_id" | tr -c 'a-zA-Z0-9\n' '_')"
psql -q "$DATABASE_URL" -c "create schema $schema" >/dev/null
sep='?'
case "$DATABASE_URL" in *\?*) sep='&' ;; esac
db_url="${DATABASE_URL}${sep}options=-c%20search_path%3D${schema}"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

"$bin" mock-provider --listen 127.0.0.1:0 --latency-ms 200 --latency-jitter-ms 50 >"$dir/mock.out" 2>"$dir/mock.log" &
pids+=($!)
for _ in $(seq 1 100); do
  mock_url=$(sed -n 's/^mock-provider listening on //p' "$dir/mock.out")
  [ -n "$mock_url" ] && break
  sleep 0.1
done
[ -n "${mock_url:-}" ] || { cat "$dir/mock.log" >&2; echo "demo: the mock provider did not start" >&2; exit 1; }

"$bin" produce --bootstrap "$KAFKA_BOOTSTRAP" --topic "$topic" --create-partitions "$partitions" \
  --count 0 >/dev/null

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
  "$bin" worker --config "$dir/$w.toml" 2>"$dir/$w.log" &
  pids+=($!)
done

start=$(date +%s.%N)
produced=$("$bin" produce --bootstrap "$KAFKA_BOOTSTRAP" --topic "$topic" --count "$tasks" \
  --duplicates "$duplicates" --malformed "$malformed")
echo "demo: published $(echo "$produced" | sed 's/,"task_ids".*/}/')" >&2

deadline=$(( $(date +%s) + limit_s ))
while :; do
  done_count=$(psql -qtA "$db_url" -c "select count(*) from reply_tasks where status in ('completed','failed')" 2>/dev/null || echo 0)
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

summary=$("$bin" check --database-url "$db_url" --bootstrap "$KAFKA_BOOTSTRAP" --topic "$topic" \
  --group "$group" --mock-url "$mock_url" --summary) || {
  echo "demo: an invariant is broken:" >&2
  "$bin" check --database-url "$db_url" --bootstrap "$KAFKA_BOOTSTRAP" --topic "$topic" \
    --group "$group" --mock-url "$mock_url" >&2 || true
  exit 1
}
echo "demo: logs in $dir" >&2
echo "demo: $summary elapsed_s=$elapsed"
