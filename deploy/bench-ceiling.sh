#!/usr/bin/env bash
# Benchmark P2 (the PostgreSQL ceiling) and the hot path's cost, side by side in one run:
#   1. one worker against a zero-latency mock drains a backlog: replies/s in the steady state
#      (the same interval as bench-window.sh), and, from PostgreSQL itself, statements per task
#      (pg_stat_statements, top level, with BEGIN and COMMIT) and transactions per task
#      (pg_stat_database.xact_commit, read after the worker has exited so that its sessions
#      have flushed their counters; the bench's own queries are subtracted);
#   2. right after, on the same database and schema, pgbench running the worker's own two
#      calls (the claim with the record's insert, then the completion) with as many clients as
#      the worker has sessions: task lifecycles/s, the ceiling. worker ÷ pgbench is the share of
#      what PostgreSQL can do here that replyd turns into replies.
# Each run uses its own schema, topic and mock; the table gives the median and the spread.
#
# Usage: deploy/bench-ceiling.sh [tasks] [window] [partitions] [runs] [pgbench_seconds]
#        (default: 20000 256 6 3 20). BENCH_POOL_SIZE (8) sets the worker's sessions and
#        pgbench's clients; REPLYD_BIN another binary (e.g. an older build, for its cost) and
#        BENCH_LABEL its name in the JSON lines; BENCH_BATCH=true|false sets
#        database.batch_completions and database.batch_claims (BENCH_BATCH_CLAIMS sets the
#        latter apart; unset: the binary's defaults). BENCH_WORKER: extra settings for the
#        worker, as `section.key=value` pairs separated by spaces or newlines (e.g.
#        BENCH_WORKER='worker.live_text_interval_ms=0 provider.stream=true' for what live text
#        costs: streamed answers, nothing forwarded; without `provider.stream=true` the worker
#        asks for whole answers when live text is off). BENCH_LISTENERS=N keeps N idle sessions
#        listening on channels nobody notifies for the whole run (every listening session of a
#        database slows every notifying commit); BENCH_NOTIFICATIONS=true adds one session that
#        listens on replyd's channels and counts what it hears (notifications per task; it is
#        a listener too, so compare runs that both have it). BENCH_APIS=N runs N `replyd api`
#        processes on the run's schema beside the worker, nobody following a reply through
#        them (API replicas between users' streams); listening_sessions in the JSON lines is how
#        many sessions of the database were listening halfway through the run. BENCH_MOCK:
#        extra mock-provider flags, e.g. BENCH_MOCK='--stream-chunk-interval-ms 20': the mock
#        streams a zero-latency answer at once, so the worker writes no live text unless its
#        deltas are paced apart (the live-text rows of docs/BENCHMARKS.md were measured at
#        20 ms a delta).
# Writes the table to stdout and one JSON line per run to target/bench/ceiling.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tasks=${1:-20000}
window=${2:-256}
partitions=${3:-6}
runs=${4:-3}
seconds=${5:-20}
pool=${BENCH_POOL_SIZE:-8}
# BENCH_WORKER's pairs, added to every run's settings; BENCH_MOCK's flags, to every mock's.
read -r -d '' -a extra <<<"${BENCH_WORKER:-}" || true
read -r -d '' -a mock_extra <<<"${BENCH_MOCK:-}" || true
listeners=${BENCH_LISTENERS:-0}
apis=${BENCH_APIS:-0}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
command -v pgbench >/dev/null || { echo "pgbench is missing (Debian: postgresql-contrib / postgresql)" >&2; exit 1; }
dir="$root/target/bench/ceiling-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/ceiling.jsonl"
clk_tck=$(getconf CLK_TCK)
# What the JSON lines call the binary measured: BENCH_LABEL, or this checkout's commit.
version=${BENCH_LABEL:-$(git rev-parse --short HEAD 2>/dev/null || echo replyd)}

psql -qtA "$DATABASE_URL" -c "create extension if not exists pg_stat_statements" >/dev/null 2>&1 || {
  echo "pg_stat_statements is not loaded (deploy/infra.sh preloads it; restart the cluster: make infra-down infra-up)" >&2
  exit 1
}

# Idle listeners: sessions that LISTEN on a channel of their own and wait, as other processes'
# listening sessions do: each psql reads a fifo this script holds open, and ends with it (or
# by its pid, with the rest).
for i in $(seq 1 "$listeners"); do
  mkfifo "$dir/idle-$i"
  psql -qtA "$DATABASE_URL" <"$dir/idle-$i" >/dev/null 2>&1 &
  pids+=("$!")
  exec {idle}>"$dir/idle-$i"
  echo "LISTEN bench_idle_$i;" >&"$idle"
done

# Transactions committed in the database so far (flushed counters only).
xacts() {
  psql -qtA "$DATABASE_URL" -c "/* bench */ select xact_commit + xact_rollback from pg_stat_database where datname = current_database()"
}

: >"$dir/runs"
for run in $(seq 1 "$runs"); do
  id="c${window}p${partitions}r${run}-$$"
  start_mock "$dir/mock-$id" --latency-ms 0 "${mock_extra[@]}"
  db_url=$(schema_url "bench_$id")
  schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
  topic="bench-$id"
  pw=$window  # each partition may fill the window (see bench-window.sh)
  write_settings "$dir/$id.toml" "database.pool_size=$pool" \
    "database.batch_completions=${BENCH_BATCH:-}" \
    "database.batch_claims=${BENCH_BATCH:+${BENCH_BATCH_CLAIMS:-$BENCH_BATCH}}" \
    kafka.session_timeout_ms=10000 "worker.worker_id=\"$id\"" "worker.partition_window=$pw" \
    "worker.global_window=$window" worker.drain_timeout_ms=5000 \
    provider.request_timeout_ms=10000 "${extra[@]}"
  "$lab" produce --config "$dir/$id.toml" --create-partitions "$partitions" \
    --count "$tasks" --conversations "$(( partitions * 8 ))" >/dev/null

  # Counters from here on: everything until the worker exits is its work, except the
  # bench's own queries (marked, counted and subtracted).
  sleep 1.5
  psql -qtA "$DATABASE_URL" -c "/* bench */ select pg_stat_statements_reset()" >/dev/null
  before=$(xacts)
  own=1
  heard=""
  if [ "${BENCH_NOTIFICATIONS:-}" = true ]; then
    # psql prints what it heard after each command: one empty command every 0.2 s (the loop
    # ends on its next write once psql is stopped).
    { echo "LISTEN replyd_task_status; LISTEN replyd_live_pieces; LISTEN replyd_live;"
      while sleep 0.2; do echo ";"; done; } | psql -qtA "$db_url" >"$dir/$id.heard" 2>&1 &
    heard=$!
    pids+=("$heard")
    own=$(( own + 1 ))
  fi
  api_pids=()
  for i in $(seq 1 "$apis"); do
    "$bin" api --config "$dir/$id.toml" 2>"$dir/$id.api-$i.log" &
    api_pids+=("$!")
    pids+=("$!")
  done
  "$bin" worker --config "$dir/$id.toml" 2>"$dir/$id.log" &
  worker=$!
  pids+=("$worker")
  deadline=$(( $(date +%s) + 900 ))
  listening=-1
  while :; do
    done_n=$(psql -qtA "$db_url" -c "/* bench */ select count(*) from reply_tasks where status = 'completed'" 2>/dev/null || echo 0)
    own=$(( own + 1 ))
    [ "$done_n" -ge "$tasks" ] && break
    if [ "$listening" -lt 0 ] && [ "$done_n" -ge $(( tasks / 2 )) ]; then
      # A session's last statement stays in pg_stat_activity while it idles: the listeners'.
      listening=$(psql -qtA "$DATABASE_URL" -c "/* bench */ select count(*) from pg_stat_activity
        where datname = current_database() and state = 'idle' and query ilike 'listen %'")
      own=$(( own + 1 ))
    fi
    [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: the backlog did not drain" >&2; exit 1; }
    sleep 0.5
  done
  own=$(( own + 1 ))
  cpu=$(awk -v t="$clk_tck" '{ print ($14 + $15) / t }' "/proc/$worker/stat")
  kill -TERM "$worker"; wait "$worker" || true
  for api_pid in "${api_pids[@]}"; do kill -TERM "$api_pid"; wait "$api_pid" || true; done
  kill -TERM "$mock_pid"; wait "$mock_pid" || true
  notifications=-1
  if [ -n "$heard" ]; then
    sleep 0.5
    kill -TERM "$heard" 2>/dev/null || true
    wait "$heard" 2>/dev/null || true
    notifications=$(grep -c '^Asynchronous notification' "$dir/$id.heard" || true)
  fi
  # Exited sessions have flushed their counters; the server publishes them within a second.
  sleep 1.5
  after=$(xacts)
  # The status trigger's commit-time statements (V32: a deferred trigger runs at COMMIT, outside
  # any client statement, so pg_stat_statements counts its two statements as top level) are
  # the server's own work inside a transaction already counted, not statements sent: left out.
  statements=$(psql -qtA "$DATABASE_URL" -c "/* bench */ select coalesce(sum(calls), 0) from pg_stat_statements
    where query not like '%/* bench */%' and query not like '%gathered%' and query <> 'SELECT set_config(\$1, \$2, \$3)'")
  psql -qtA -F ' ' "$DATABASE_URL" -c "/* bench */ select calls, regexp_replace(left(query, 90), '\s+', ' ', 'g') from pg_stat_statements where query not like '%/* bench */%' order by calls desc limit 8" >"$dir/$id.statements"
  read -r steady_n steady_s < <(psql -qtA -F ' ' "$db_url" -c "
    with c as (select claimed_at, row_number() over (order by claimed_at) as n from reply_attempts)
    select $tasks - 2 * $window, extract(epoch from
      (select claimed_at from c where n = $tasks - $window + 1) - (select claimed_at from c where n = $window + 1))")

  # The ceiling: the worker's two calls from pgbench, on the same schema, right after.
  # jsonb's text has a space after each colon, so pgbench sees no variable in it.
  request=$(psql -qtA "$db_url" -c "select request::text from reply_tasks limit 1")
  if printf '%s' "$request" | grep -q ':[A-Za-z0-9_]'; then
    echo "bench: the request JSON has a ':name' pgbench would take for a variable: $request" >&2
    exit 1
  fi
  # The claim as the worker sends it: from V21 on it also names the record's partition and
  # offset (the earlier signature stays, for the previous release, as a wrapper).
  claim_args=$(psql -qtA "$db_url" -c "select coalesce(max(pronargs), 0) from pg_proc
    where proname = 'replyd_claim' and pronamespace = current_schema()::regnamespace")
  source=""
  [ "$claim_args" -ge 12 ] && source=", :client_id, 0"
  cat >"$dir/lifecycle.sql" <<SQL
SELECT task_id AS t, assignment_version AS v FROM replyd_claim(gen_random_uuid(), 'pgbench', 30, 'ws-bench', 'conv-' || :client_id, 'msg', '', \$j\$$request\$j\$::jsonb, 3, NULL$source) \gset
SELECT accepted FROM replyd_complete(:t, :v, 'A saved reply of a typical length for a chat answer.', NULL);
SQL
  # A binary older than the functions (migration V9) has no ceiling of its own shape here.
  ceiling=0
  if [ "$claim_args" -gt 0 ]; then
    pgbench -n -M prepared -c "$pool" -j 2 -T "$seconds" -f "$dir/lifecycle.sql" "$db_url" >"$dir/$id.pgbench" 2>&1 \
      || { cat "$dir/$id.pgbench" >&2; exit 1; }
    ceiling=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$dir/$id.pgbench" | head -n 1)
  fi
  psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true

  awk -v n="$tasks" -v sn="$steady_n" -v ss="$steady_s" -v c="$ceiling" -v st="$statements" \
      -v x0="$before" -v x1="$after" -v own="$own" -v cpu="$cpu" -v w="$window" -v p="$partitions" \
      -v run="$run" -v pool="$pool" -v bin="$version" -v batched="${BENCH_BATCH:-default}" \
      -v heard="$notifications" -v listeners="$listeners" -v extra="${BENCH_WORKER:-}" \
      -v apis="$apis" -v listening="$listening" -v mock="${BENCH_MOCK:-}" 'BEGIN {
    rate = sn / ss
    ratio = c > 0 ? rate / c : 0
    # Each psql of the bench is two transactions: its connection start-up and its query.
    tx = (x1 - x0 - 2 * own) / n
    notified = (heard < 0 ? -1 : heard / n)
    printf "%f %f %f %f %f %f %f\n", rate, c, ratio, st / n, tx, cpu / n * 1e6, notified > "/dev/stderr"
    gsub(/["\\]/, "", extra)
    gsub(/[ \n]+/, " ", extra)
    gsub(/["\\]/, "", mock)
    gsub(/[ \n]+/, " ", mock)
    printf "{\"bench\":\"ceiling\",\"binary\":\"%s\",\"batched\":\"%s\",\"worker\":\"%s\",\"mock\":\"%s\",\"idle_listeners\":%d,\"apis\":%d,\"listening_sessions\":%d,\"notifications_per_task\":%.2f,", bin, batched, extra, mock, listeners, apis, listening, notified
    printf "\"window\":%d,\"partitions\":%d,\"pool\":%d,\"run\":%d,\"tasks\":%d,\"replies_per_s\":%.1f,\"pgbench_lifecycles_per_s\":%.1f,\"ratio\":%.3f,\"statements_per_task\":%.2f,\"transactions_per_task\":%.2f,\"worker_cpu_us_per_record\":%.0f}\n",
      w, p, pool, run, n, rate, c, ratio, st / n, tx, cpu / n * 1e6
  }' 2>>"$dir/runs" >>"$jsonl"
  echo "bench: run $run: $(tail -n 1 "$dir/runs")" >&2
  sed 's/^/    /' "$dir/$id.statements" >&2
done

read -r rate_m rate_lo rate_hi < <(cut -d' ' -f1 "$dir/runs" | stats)
read -r ceil_m ceil_lo ceil_hi < <(cut -d' ' -f2 "$dir/runs" | stats)
read -r ratio_m ratio_lo ratio_hi < <(cut -d' ' -f3 "$dir/runs" | stats)
read -r st_m _ _ < <(cut -d' ' -f4 "$dir/runs" | stats)
read -r tx_m _ _ < <(cut -d' ' -f5 "$dir/runs" | stats)
read -r cpu_m _ _ < <(cut -d' ' -f6 "$dir/runs" | stats)
read -r heard_m _ _ < <(cut -d' ' -f7 "$dir/runs" | stats)
echo "| window | partitions | tasks | worker replies/s (median, min–max) | pgbench lifecycles/s (median, min–max) | ratio (median, min–max) | statements/task | transactions/task | worker CPU µs/record | notifications/task |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
awk -v w="$window" -v p="$partitions" -v n="$tasks" -v rm="$rate_m" -v rl="$rate_lo" -v rh="$rate_hi" \
    -v cm="$ceil_m" -v cl="$ceil_lo" -v ch="$ceil_hi" -v qm="$ratio_m" -v ql="$ratio_lo" -v qh="$ratio_hi" \
    -v st="$st_m" -v tx="$tx_m" -v cpu="$cpu_m" -v heard="$heard_m" 'BEGIN {
  printf "| %d | %d | %d | %.0f (%.0f–%.0f) | %.0f (%.0f–%.0f) | **%.2f** (%.2f–%.2f) | %.2f | %.2f | %.0f | %s |\n",
    w, p, n, rm, rl, rh, cm, cl, ch, qm, ql, qh, st, tx, cpu, (heard < 0 ? "not counted" : sprintf("%.2f", heard))
}'
