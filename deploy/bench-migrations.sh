#!/usr/bin/env bash
# Benchmark: how long the newest migrations take on a large schema, and what they lock.
# A throwaway database is migrated with psql up to the migration before the last LAST ones,
# seeded with TASKS tasks (mostly finished, one open in 2,000; one attempt and one message per
# task, five messages a conversation, 20 workspaces with 5 API keys each), vacuumed, and then
# each of the last LAST migrations is applied alone, in one transaction as refinery applies it,
# under the service's session settings (`statement_timeout = 30s`, `lock_timeout = 5s`,
# src/store/settings.rs). For each: wall time, whether it passed, and the locks it held on
# tables at its end (pg_locks of its own session, read before the commit). Then, for
# comparison, the heavy statements of V20 (a unique index built without CONCURRENTLY) and V22
# (a backfill of every message), timed with no statement timeout inside a transaction that is
# rolled back, and V20's index built CONCURRENTLY (then dropped).
#
# Usage: deploy/bench-migrations.sh [tasks] [last]     (default: 10000000 6)
# Seeding 10,000,000 tasks takes 8 to 10 minutes on 2 cores and about 11 GB of disk (one
# session: the machine stays usable). The database is dropped on exit, whatever happens.
# Writes the table to stdout and one JSON line per run to target/bench/migrations.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tasks=${1:-10000000}
last=${2:-6}
[[ "$tasks" =~ ^[0-9]+$ && "$tasks" -ge 1000 && "$tasks" -le 100000000 ]] ||
  { echo "tasks: a number from 1,000 to 100,000,000" >&2; exit 2; }
[[ "$last" =~ ^[0-9]+$ && "$last" -ge 1 ]] || { echo "last: a number ≥ 1" >&2; exit 2; }

bash deploy/infra.sh up postgres >/dev/null
set -a
# shellcheck disable=SC1091 # the infrastructure's own file
. target/infra/env
set +a
command -v psql >/dev/null || { echo "psql is missing (Debian: postgresql-client)" >&2; exit 1; }

db=replyd_bench_migrations
url="${DATABASE_URL%/*}/$db"
admin() { psql -qX -v ON_ERROR_STOP=1 "$DATABASE_URL" -c "$1" >/dev/null; }
drop_db() { admin "drop database if exists $db with (force)" || true; }
trap drop_db EXIT
drop_db
admin "create database $db"
sql() { psql -qtAX -v ON_ERROR_STOP=1 "$url" -c "$1"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# The migrations by version; the last $last are measured, the ones before set up the schema.
mapfile -t files < <(ls migrations/V*__*.sql | awk -F'[V_]' '{ print $2 " " $0 }' |
  sort -n | cut -d' ' -f2)
count=${#files[@]}
[ "$last" -lt "$count" ] || { echo "only $count migrations" >&2; exit 2; }
setup=("${files[@]:0:count-last}")
measured=("${files[@]:count-last}")
echo "schema: ${#setup[@]} migrations up to $(basename "${setup[-1]}")" >&2
for f in "${setup[@]}"; do psql -qX -v ON_ERROR_STOP=1 -1 -f "$f" "$url" >/dev/null; done

# Seeding: one session, a million tasks a statement, triggers and foreign-key checks off
# (session_replication_role; the cluster's user is a superuser) so that only the rows cost.
echo "seeding $tasks tasks" >&2
started=$(now)
sql "insert into workspaces (workspace_id)
       select 'ws-' || lpad(w::text, 2, '0') from generate_series(0, 19) w;
     insert into api_keys (key_id, workspace_id, key_hash)
       select 'key-' || w || '-' || k, 'ws-' || lpad(w::text, 2, '0'), md5(w || '/' || k)
         from generate_series(0, 19) w, generate_series(1, 5) k;
     insert into capacity_buckets (bucket)
       select 'provider-' || b from generate_series(1, 4) b;"
chunk=1000000
for ((from = 1; from <= tasks; from += chunk)); do
  to=$((from + chunk - 1 < tasks ? from + chunk - 1 : tasks))
  psql -qX -v ON_ERROR_STOP=1 "$url" >/dev/null <<SQL
set session_replication_role = replica;
-- Task i: conversation i / 5 (five messages each), its workspace that conversation's modulo 20;
-- one task in 2,000 open (half pending, half running), 1 % failed, 0.2 % cancelled, the rest
-- completed; created over the last ~35 days, one every 0.3 s.
create temp table seed as
select i, md5('task' || i)::uuid as task_id,
       'ws-' || lpad(((i / 5) % 20)::text, 2, '0') as workspace_id,
       'conv-' || (i / 5) as conversation_id,
       md5('message' || i)::uuid as message_id,
       case when i % 4000 = 0 then 'pending' when i % 2000 = 0 then 'running'
            when i % 100 = 1 then 'failed' when i % 500 = 2 then 'cancelled'
            else 'completed' end as status,
       now() - ($tasks - i) * interval '0.3 s' as created_at
  from generate_series($from, $to) i;
insert into reply_tasks (task_id, workspace_id, conversation_id, message_id, request, status,
                         assignment_version, lease_owner, lease_until, attempt_count,
                         max_attempts, saved_response, failure, created_at, updated_at,
                         finished_at, source_partition, source_offset)
select task_id, workspace_id, conversation_id, message_id::text,
       jsonb_build_object('messages', jsonb_build_array(jsonb_build_object(
           'role', 'user', 'content', 'A question of a typical length for a chat, ' || i)),
           'max_tokens', 256),
       status, case when status = 'pending' then 0 else 1 end,
       case when status <> 'pending' then 'worker-' || (i % 4) || '#seed' end,
       case when status <> 'pending' then created_at + interval '30 s' end,
       case when status = 'pending' then 0 else 1 end, 3,
       case when status = 'completed'
            then 'A saved reply of a typical length for a chat answer, number ' || i end,
       case when status = 'failed' then 'provider_error: 500 Internal Server Error' end,
       created_at, created_at + interval '2 s',
       case when status in ('completed', 'failed', 'cancelled')
            then created_at + interval '2 s' end,
       i % 12, i / 12
  from seed;
insert into reply_attempts (task_id, attempt_no, assignment_version, worker, claimed_at,
                            lease_until, finished_at, outcome, prompt_tokens,
                            completion_tokens, source_partition, source_offset)
select task_id, 1, 1, 'worker-' || (i % 4) || '#seed', created_at, created_at + interval '30 s',
       case when status <> 'running' then created_at + interval '2 s' end,
       case status when 'completed' then 'accepted' when 'failed' then 'provider_error'
                   when 'cancelled' then 'cancelled' end,
       case when status = 'completed' then 120 end,
       case when status = 'completed' then 200 end,
       i % 12, i / 12
  from seed where status <> 'pending';
insert into messages (message_id, workspace_id, conversation_id, content, created_at, seq)
select message_id, workspace_id, conversation_id,
       'A question of a typical length for a chat, ' || i, created_at, i % 5 + 1
  from seed;
insert into conversations (workspace_id, conversation_id, last_seq, created_at)
select workspace_id, conversation_id, 5, created_at from seed where i % 5 = 0;
SQL
  echo "  $to tasks, $(secs "$started" "$(now)") s" >&2
done
sql "vacuum analyze" >/dev/null
seed_s=$(secs "$started" "$(now)")
sizes=$(sql "select string_agg(format('%s %s', relname, pg_size_pretty(pg_total_relation_size(oid))), ', ' order by relname)
  from pg_class where relname in ('reply_tasks', 'reply_attempts', 'messages', 'conversations') and relkind = 'r'")
echo "seeded in $seed_s s: $sizes" >&2

# One migration as refinery runs it (one transaction, the service's timeouts), with the locks
# its session holds on tables just before the commit. Prints "seconds|passed|locks|error".
locks_sql="select coalesce(string_agg(format('%s %s', c.relname, l.mode), ', '
                                    order by c.relname, l.mode), 'none')
  from pg_locks l join pg_class c on c.oid = l.relation
 where l.pid = pg_backend_pid() and l.locktype = 'relation' and c.relkind in ('r', 'p')
   and c.relnamespace = 'public'::regnamespace and l.mode <> 'AccessShareLock'"
apply() {
  local file=$1 timeouts=$2 out t0 t1 rc=0
  t0=$(now)
  out=$( { echo "$timeouts"; echo "begin;"; echo "\\i $file"; echo "\\pset format unaligned"
           echo "\\pset tuples_only on"; echo "$locks_sql;"; echo "commit;"; } |
         psql -qX -v ON_ERROR_STOP=1 "$url" 2>&1) || rc=$?
  t1=$(now)
  if [ "$rc" -eq 0 ]; then
    echo "$(secs "$t0" "$t1")|yes|$(echo "$out" | tail -n1)|"
  else
    echo "$(secs "$t0" "$t1")|no||$(echo "$out" | grep -m1 ERROR | tr '|' '/')"
  fi
}
service="set statement_timeout = '30s'; set lock_timeout = '5s';"
unbounded="set statement_timeout = 0; set lock_timeout = '5s';"

jsonl="$root/target/bench/migrations.jsonl"
mkdir -p "$(dirname "$jsonl")"
rows=()
echo "| migration | seconds on $tasks tasks | passes 30 s / 5 s | locks held at its end (besides AccessShare) |"
echo "|---|---|---|---|"
for f in "${measured[@]}"; do
  name=$(basename "$f" .sql)
  IFS='|' read -r s ok locks err < <(apply "$f" "$service")
  echo "| $name | $s | $ok${err:+ ($err)} | $locks |"
  rows+=("{\"migration\": \"$name\", \"seconds\": $s, \"passed\": \"$ok\"}")
done

# For comparison: V20 and V22 on the same data, with no statement timeout, each in a
# transaction rolled back (their columns, table and index are copies under other names). Each
# statement is timed (psql's \timing): the service's timeout is per statement.
compare() {
  local name=$1 body=$2 t0 t1 out times max
  t0=$(now)
  out=$( { echo "$unbounded"; echo "\\timing on"; echo "begin;"; echo "$body"
           echo "\\timing off"; echo "\\pset format unaligned"; echo "\\pset tuples_only on"
           echo "$locks_sql;"; echo "rollback;"; } |
         psql -qX -v ON_ERROR_STOP=1 "$url" 2>&1)
  t1=$(now)
  # The statements' times in seconds, BEGIN's left out.
  times=$(echo "$out" | awk '/^Time: / { n++; if (n > 1) printf "%s%.1f", (n > 2 ? " + " : ""), $2 / 1000 }')
  max=$(echo "$out" | awk '/^Time: / { if ($2 > m) m = $2 } END { print m / 1000 }')
  echo "| $name | $(secs "$t0" "$t1") ($times) | $(awk -v m="$max" 'BEGIN { print (m < 30) ? "yes" : "no" }') | $(echo "$out" | tail -n1) |"
  rows+=("{\"migration\": \"$name\", \"seconds\": $(secs "$t0" "$t1"), \"statements\": \"$times\"}")
}
compare "V20: reply_tasks.retry_of (a foreign key) and its unique index" \
  "alter table reply_tasks add column retry_of_again uuid references reply_tasks;
   create unique index reply_tasks_retry_of_again on reply_tasks (retry_of_again)
    where retry_of_again is not null;"
compare "V22: conversations from messages, messages.seq backfilled, not null, unique index" \
  "alter table messages add column seq_again bigint;
   create temp table conversations_again as
   select workspace_id, conversation_id, count(*) as last_seq, min(created_at) as created_at
     from messages group by workspace_id, conversation_id;
   update messages m set seq_again = n.seq
     from (select message_id,
                  row_number() over (partition by workspace_id, conversation_id
                                     order by created_at, message_id) as seq
             from messages) n
    where n.message_id = m.message_id;
   alter table messages alter column seq_again set not null;
   create unique index messages_in_order_again on messages (workspace_id, conversation_id, seq_again);"
t0=$(now)
psql -qX -v ON_ERROR_STOP=1 "$url" -c "set statement_timeout = 0" \
  -c "create unique index concurrently reply_tasks_retry_of_again on reply_tasks (retry_of) where retry_of is not null" >/dev/null
s=$(secs "$t0" "$(now)")
sql "drop index reply_tasks_retry_of_again" >/dev/null
echo "| V20's index built CONCURRENTLY (outside a transaction) | $s | yes (no statement timeout) | ShareUpdateExclusiveLock on reply_tasks: writers go on |"
rows+=("{\"migration\": \"V20 concurrently\", \"seconds\": $s}")

printf '{"at": "%s", "tasks": %s, "seed_s": %s, "runs": [%s]}\n' "$(date -u +%FT%TZ)" "$tasks" \
  "$seed_s" "$(IFS=,; echo "${rows[*]}")" >>"$jsonl"
