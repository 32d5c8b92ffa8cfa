#!/usr/bin/env bash
# make bench-api: the intake API at its limit, beside PostgreSQL running the same transaction.
#   1. POST /v1/replies with a new Idempotency-Key per request, CLIENTS connections, DURATION s
#      (wrk): requests/s and p50/p99 latency.
#   2. pgbench on the same database, right after, running the intake transaction's own
#      statements (DELETE of an expired key, INSERT task, key, message, outbox row, the quota
#      admission with its reservation; prepared),
#      with as many clients as the API has pooled connections (database.pool_size): the ratio
#      API ÷ pgbench is the share of what PostgreSQL can commit that the API turns into answers.
#   3. Replays: one key, the same body, CLIENTS connections: requests/s and p50/p99.
#   4. The front half's end-to-end overhead at a modest load: `replyd-lab browsers` (8 at once, no
#      faults) through API → outbox → relay → Kafka → worker → SSE, mock at a fixed latency;
#      overhead = POST-to-completion-event minus the mock's latency, p50/p99.
#
#   deploy/bench-api.sh [CLIENTS] [DURATION_S]
# Installs wrk (Debian) when missing. Figures go to target/bench/<id>/ and one summary line.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
clients=${1:-64}
duration=${2:-20}
mock_latency_ms=${BENCH_MOCK_LATENCY_MS:-100}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
if ! command -v wrk >/dev/null; then
  echo "installing wrk" >&2
  sudo_=""
  [ "$(id -u)" -eq 0 ] || sudo_=sudo
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
fi
command -v pgbench >/dev/null || { echo "pgbench is missing (Debian: postgresql-contrib / postgresql)" >&2; exit 1; }

id="api-$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/bench/$id"
mkdir -p "$dir"
db_url=$(schema_url "bench_$id")
start_mock "$dir/mock" --latency-ms "$mock_latency_ms"
pool_size=16
topic="bench-$id"
# One key presses for every simulated browser here: the per-key limit is not what this runs.
for name in api relay w1; do
  write_settings "$dir/$name.toml" "database.pool_size=$pool_size" "worker.worker_id=\"$name\"" \
    worker.drain_timeout_ms=5000 worker.commit_interval_ms=200 api.rate_limit_per_second=0 \
    relay.poll_interval_ms=200
done
"$bin" migrate --config "$dir/api.toml" 2>"$dir/migrate.log"
"$bin" workspace create bench --config "$dir/api.toml" >/dev/null
key=$("$bin" api-key create --workspace bench --config "$dir/api.toml" 2>/dev/null)
"$bin" api --config "$dir/api.toml" 2>"$dir/api.log" &
pids+=($!)
api=$(api_addr "$dir/api.log")

body='{"conversation_id":"conv-1","message":"What are the key decisions in this document?","document_version":"v7"}'
cat >"$dir/new-keys.lua" <<LUA
-- A new Idempotency-Key per request: the thread's own prefix and a counter.
local counter = 0
local prefix = ""
function setup(thread)
  thread:set("prefix", tostring(math.random(1, 2^30)))
end
function init(args)
  prefix = wrk.thread:get("prefix") or tostring(math.random(1, 2^30))
end
request = function()
  counter = counter + 1
  local headers = {
    ["Authorization"] = "Bearer $key",
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "bench-" .. prefix .. "-" .. counter,
  }
  return wrk.format("POST", "/v1/replies", headers, '$body')
end
LUA
cat >"$dir/same-key.lua" <<LUA
wrk.method = "POST"
wrk.path = "/v1/replies"
wrk.body = '$body'
wrk.headers["Authorization"] = "Bearer $key"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Idempotency-Key"] = "bench-replayed"
LUA

# wrk_figures FILE: "rps p50_ms p99_ms non2xx" from wrk --latency output.
wrk_figures() {
  awk '
    function ms(v) { if (v ~ /us$/) return v / 1000; if (v ~ /ms$/) return v + 0; if (v ~ /s$/) return v * 1000; return v }
    /Requests\/sec:/ { rps = $2 }
    /^ +50%/ { p50 = ms($2) }
    /^ +99%/ { p99 = ms($2) }
    /Non-2xx or 3xx responses:/ { bad = $5 }
    END { printf "%.0f %.1f %.1f %d\n", rps, p50, p99, bad + 0 }' "$1"
}

threads=2
echo "bench: POST /v1/replies, new keys, $clients connections, ${duration}s" >&2
wrk -t"$threads" -c"$clients" -d"${duration}s" --latency -s "$dir/new-keys.lua" "http://$api" >"$dir/wrk-new.txt"
read -r api_rps api_p50 api_p99 api_bad < <(wrk_figures "$dir/wrk-new.txt")
tasks_made=$(psql -qtA "$db_url" -c "select count(*) from reply_tasks")

# The same transaction from pgbench: ids derived from pgbench's variables in SQL, so the
# statements are the intake's own (one round trip each), with no extra query to make them.
# The JSON values are built with jsonb_build_object: pgbench would read `:null` inside a JSON
# literal as one of its variables.
cat >"$dir/intake.sql" <<'SQL'
\set n random(1, 9000000000000000000)
BEGIN;
DELETE FROM idempotency_keys WHERE workspace_id = 'bench' AND operation = 'create_reply' AND idempotency_key = 'pgb-' || :client_id || '-' || :n AND expires_at <= clock_timestamp();
INSERT INTO reply_tasks (task_id, workspace_id, conversation_id, message_id, document_version, request, max_attempts) VALUES (md5('t' || :client_id || '-' || :n)::uuid, 'bench', 'conv-1', md5('m' || :client_id || '-' || :n)::text, 'v7', jsonb_build_object('model', NULL, 'messages', jsonb_build_array(jsonb_build_object('role', 'user', 'content', 'What are the key decisions in this document?')), 'max_output_tokens', NULL), 3);
INSERT INTO idempotency_keys (workspace_id, operation, idempotency_key, request_hash, request, task_id, expires_at) VALUES ('bench', 'create_reply', 'pgb-' || :client_id || '-' || :n, md5('h' || :n), jsonb_build_object('conversation_id', 'conv-1', 'message', 'What are the key decisions in this document?', 'document_version', 'v7', 'model', NULL, 'context', NULL, 'max_output_tokens', NULL, 'source_task', NULL), md5('t' || :client_id || '-' || :n)::uuid, clock_timestamp() + make_interval(secs => 86400)) ON CONFLICT DO NOTHING RETURNING task_id;
INSERT INTO messages (message_id, workspace_id, conversation_id, content) VALUES (md5('m' || :client_id || '-' || :n)::uuid, 'bench', 'conv-1', 'What are the key decisions in this document?');
INSERT INTO outbox (task_id, record_key, payload) VALUES (md5('t' || :client_id || '-' || :n)::uuid, 'conv-1', decode(repeat('0a24', 60), 'hex'));
WITH now AS (SELECT clock_timestamp() AS at), admitted AS (UPDATE quota_counters q SET used = CASE WHEN replyd_quota_window(q.window_start, q.period_seconds, now.at) = q.window_start THEN q.used ELSE 0 END, window_start = replyd_quota_window(q.window_start, q.period_seconds, now.at), reserved = q.reserved + 1, updated_at = now.at FROM now WHERE q.workspace_id = 'bench' AND EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.workspace_id = 'bench' AND k.operation = 'create_reply' AND k.idempotency_key = 'pgb-' || :client_id || '-' || :n AND k.task_id = md5('t' || :client_id || '-' || :n)::uuid) AND (q.generation_limit IS NULL OR CASE WHEN replyd_quota_window(q.window_start, q.period_seconds, now.at) = q.window_start THEN q.used ELSE 0 END + q.reserved < q.generation_limit) RETURNING q.workspace_id, now.at) INSERT INTO quota_reservations (task_id, workspace_id, operation, idempotency_key, expires_at, charge_on_failure) SELECT md5('t' || :client_id || '-' || :n)::uuid, workspace_id, 'create_reply', 'pgb-' || :client_id || '-' || :n, at + make_interval(secs => 3600), false FROM admitted RETURNING task_id;
COMMIT;
SQL
echo "bench: pgbench, the intake transaction, $pool_size clients, ${duration}s" >&2
pgbench -n -M prepared -c "$pool_size" -j "$threads" -T "$duration" -r -f "$dir/intake.sql" "$db_url" >"$dir/pgbench.txt" 2>&1
pg_tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$dir/pgbench.txt" | head -n 1)
pg_lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$dir/pgbench.txt" | head -n 1)

echo "bench: POST /v1/replies, one key (replays), $clients connections, ${duration}s" >&2
curl_body=$(printf '%s' "$body")
# The first request makes the task; every later one is a replay.
exec 3<>"/dev/tcp/${api%:*}/${api##*:}"
printf 'POST /v1/replies HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nIdempotency-Key: bench-replayed\r\nContent-Length: %d\r\n\r\n%s' \
  "$key" "${#curl_body}" "$curl_body" >&3
cat <&3 >/dev/null
exec 3>&-
wrk -t"$threads" -c"$clients" -d"${duration}s" --latency -s "$dir/same-key.lua" "http://$api" >"$dir/wrk-replay.txt"
read -r replay_rps replay_p50 replay_p99 replay_bad < <(wrk_figures "$dir/wrk-replay.txt")
replay_tasks=$(psql -qtA "$db_url" -c "select count(*) from idempotency_keys where idempotency_key = 'bench-replayed'")

# 4. End-to-end overhead at a modest load, through the whole chain. The rows of the load runs
# (and pgbench's, whose payloads are not records) are removed first: only the browsers' work
# goes through the relay and the worker.
echo "bench: end-to-end overhead, mock at ${mock_latency_ms} ms" >&2
psql -q "$db_url" -c "truncate outbox, idempotency_keys, messages, quota_reservations, quota_decisions, reply_tasks cascade" -c "update quota_counters set used = 0, reserved = 0"
"$lab" produce --config "$dir/api.toml" --create-partitions 3 --count 0 >/dev/null
"$bin" relay --config "$dir/relay.toml" 2>"$dir/relay.log" &
pids+=($!)
"$bin" worker --config "$dir/w1.toml" 2>"$dir/w1.log" &
pids+=($!)
wait_until_assigned 60 "$dir/w1.log"
REPLYD_API_KEY=$key "$lab" browsers --api "http://$api" --presses 400 --concurrency 8 \
  --lose-share 0 --double-click-share 0 --regenerate-share 0 >"$dir/browsers.json" 2>"$dir/browsers.log"
e2e_p50=$(sed -n 's/.*"e2e_ms_p50":\([0-9]*\).*/\1/p' "$dir/browsers.json")
e2e_p99=$(sed -n 's/.*"e2e_ms_p99":\([0-9]*\).*/\1/p' "$dir/browsers.json")

ratio=$(awk -v a="$api_rps" -v p="$pg_tps" 'BEGIN { printf "%.2f", a / p }')
echo "bench: figures in $dir" >&2
echo "bench-api: clients=$clients api_posts_per_s=$api_rps api_p50_ms=$api_p50 api_p99_ms=$api_p99 api_non_2xx=$api_bad tasks_made=$tasks_made pgbench_clients=$pool_size pgbench_tps=$pg_tps pgbench_latency_ms=$pg_lat ratio_to_pgbench=$ratio replays_per_s=$replay_rps replay_p50_ms=$replay_p50 replay_p99_ms=$replay_p99 replay_non_2xx=$replay_bad replayed_key_tasks=$replay_tasks e2e_ms_p50=$e2e_p50 e2e_ms_p99=$e2e_p99 overhead_ms_p50=$((e2e_p50 - mock_latency_ms)) overhead_ms_p99=$((e2e_p99 - mock_latency_ms))"
