#!/usr/bin/env bash
# make bench-check: the memory `replyd check` needs as the data grows. For each size N, a
# topic of N task records and a schema of N completed tasks (each with its accepted attempt,
# and the records' own task ids) are made, then `replyd check` runs once under GNU time:
# its peak resident memory and wall time. The check reads the topics in batches and lets
# PostgreSQL count the tasks, so the peak should not grow with N.
#
#   deploy/bench-check.sh [SIZES...]      (default: 10000 100000 1000000)
# Writes one JSON line per size to target/bench/check.jsonl and a table to stdout.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(10000 100000 1000000)

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
[ -x /usr/bin/time ] || { echo "bench-check needs GNU time (/usr/bin/time; apt-get install time)" >&2; exit 1; }

run_id="check-$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/bench/$run_id"
mkdir -p "$dir"
jsonl="$root/target/bench/check.jsonl"

echo "| tasks and records | peak RSS, MiB | check wall time, s | records read | tasks |"
echo "|---:|---:|---:|---:|---:|"
for n in "${sizes[@]}"; do
  id="$run_id-$n"
  db_url=$(schema_url "bench_$id")
  topic="bench-$id"
  write_settings "$dir/$n.toml"
  "$bin" migrate --config "$dir/$n.toml" 2>/dev/null
  "$lab" produce --config "$dir/$n.toml" --create-partitions 6 --count "$n" \
    --conversations 600 --ids-file "$dir/$n.ids" >/dev/null
  # The records' tasks, completed, each with the attempt that saved its reply.
  psql -q "$db_url" -v ON_ERROR_STOP=1 <<SQL
create temporary table ids (task_id uuid);
\copy ids from '$dir/$n.ids'
insert into reply_tasks (task_id, workspace_id, conversation_id, message_id, request, status,
                         assignment_version, attempt_count, max_attempts, saved_response,
                         finished_at)
  select task_id, 'ws-demo', 'c', task_id::text, '{}'::jsonb, 'completed', 1, 1, 3, 'a reply',
         clock_timestamp()
  from ids;
insert into reply_attempts (task_id, attempt_no, assignment_version, worker, lease_until,
                            finished_at, outcome)
  select task_id, 1, 1, 'bench', clock_timestamp(), clock_timestamp(), 'accepted' from ids;
SQL
  /usr/bin/time -f '%M %e' -o "$dir/$n.time" "$bin" check --json --config "$dir/$n.toml" \
    >"$dir/$n.report.json" 2>"$dir/$n.log" || true
  read -r rss_kib wall <"$dir/$n.time"
  records=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["records"])' "$dir/$n.report.json")
  tasks=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tasks"])' "$dir/$n.report.json")
  rss_mib=$(python3 -c "print(round($rss_kib / 1024, 1))")
  echo "| $n | $rss_mib | $wall | $records | $tasks |"
  printf '{"size":%s,"peak_rss_mib":%s,"wall_s":%s,"records":%s,"tasks":%s}\n' \
    "$n" "$rss_mib" "$wall" "$records" "$tasks" >>"$jsonl"
  psql -q "$DATABASE_URL" -c "set client_min_messages = warning" -c "drop schema $(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_') cascade" >/dev/null
done
