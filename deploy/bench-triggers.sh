#!/usr/bin/env bash
# Benchmark: what each trigger of the schema costs the hot path. pgbench runs the worker's own
# two calls (the claim with the record's insert, then the completion: a fault-free task's
# statement shapes) on a freshly migrated schema, with PostgreSQL timing every PL/pgSQL
# function (track_functions = pl): a trigger's cost is its function's time per task lifecycle,
# beside the time of the two calls themselves (which holds the triggers fired inside them) and
# pgbench's latency per lifecycle (which also holds the commit, TLS and the way there and
# back). Turning one trigger off at a time and comparing rates was tried first: on this box a
# few percent drowns in run-to-run noise of ±20 %. Each round also runs with every trigger off
# and every trigger on, alternately, for the rate the triggers cost together.
#
# Usage: deploy/bench-triggers.sh [seconds] [rounds]     (default: 8 3)
#        BENCH_POOL_SIZE (8) sets pgbench's clients, as many as a worker's sessions.
# Writes the table to stdout and one JSON line per round to target/bench/triggers.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${1:-8}
rounds=${2:-3}
clients=${BENCH_POOL_SIZE:-8}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
command -v pgbench >/dev/null || { echo "pgbench is missing (Debian: postgresql-contrib / postgresql)" >&2; exit 1; }
dir="$root/target/bench/triggers-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/triggers.jsonl"
version=$(basename "$(dirname "$bin")")

db_url=$(schema_url "bench_triggers_$$")
topic="bench-triggers-$$"
write_settings "$dir/settings.toml"
"$bin" migrate --config "$dir/settings.toml" 2>"$dir/migrate.log"
sql() { psql -qtA -v ON_ERROR_STOP=1 "$db_url" -c "$1"; }

# The claim as the worker sends it: from V21 on it also names the record's partition and offset.
claim_args=$(sql "select max(pronargs) from pg_proc
  where proname = 'replyd_claim' and pronamespace = current_schema()::regnamespace")
source=""
[ "$claim_args" -ge 12 ] && source=", :client_id, 0"
request='{"messages": [{"role": "user", "content": "A question of a typical length for a chat."}], "max_tokens": 256}'
cat >"$dir/lifecycle.sql" <<SQL
SELECT task_id AS t, assignment_version AS v FROM replyd_claim(gen_random_uuid(), 'pgbench', 30, 'ws-bench', 'conv-' || :client_id, 'msg', '', \$j\$$request\$j\$::jsonb, 3, NULL$source) \gset
SELECT accepted FROM replyd_complete(:t, :v, 'A saved reply of a typical length for a chat answer.', NULL);
SQL

# Every trigger a migration made (not the ones PostgreSQL keeps for foreign keys), as
# "table trigger" lines.
mapfile -t triggers < <(sql "select c.relname || ' ' || t.tgname from pg_trigger t
  join pg_class c on c.oid = t.tgrelid
  where c.relnamespace = current_schema()::regnamespace and not t.tgisinternal
  order by c.relname, t.tgname")
tables=$(sql "select string_agg(quote_ident(relname), ', ') from pg_class
  where relnamespace = current_schema()::regnamespace and relkind = 'r'")
functions="select p.oid from pg_proc p where p.pronamespace = current_schema()::regnamespace"
# The sessions pgbench opens time every PL/pgSQL function (a superuser setting: the
# throwaway cluster's user is one).
timed_url="${db_url}%20-c%20track_functions%3Dpl"

switch() {  # switch enable|disable: every trigger of the list
  local entry table trigger
  for entry in "${triggers[@]}"; do
    read -r table trigger <<<"$entry"
    sql "alter table $table $1 trigger $trigger"
  done
}

rate() {  # rate LABEL URL: empties the tables, runs pgbench, prints "lifecycles/s latency_ms"
  sql "truncate $tables cascade" >/dev/null
  sql "vacuum analyze" >/dev/null 2>&1 || true
  pgbench -n -M prepared -c "$clients" -j 2 -T "$seconds" -f "$dir/lifecycle.sql" "$2" \
    >"$dir/$1.pgbench" 2>&1 || { cat "$dir/$1.pgbench" >&2; exit 1; }
  printf '%s %s\n' "$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$dir/$1.pgbench" | head -n 1)" \
    "$(sed -n 's/^latency average = \([0-9.]*\) ms.*/\1/p' "$dir/$1.pgbench" | head -n 1)"
}

: >"$dir/functions.tsv"
for round in $(seq 1 "$rounds"); do
  sql "select pg_stat_reset_single_function_counters(oid) from ($functions) f" >/dev/null
  order=(on off)
  [ $((round % 2)) -eq 1 ] || order=(off on)
  for variant in "${order[@]}"; do
    # An assignment, so that a failed pgbench stops the script (set -e).
    if [ "$variant" = on ]; then
      result=$(rate "r$round-on" "$timed_url")
      read -r on latency <<<"$result"
    else
      switch disable
      result=$(rate "r$round-off" "$db_url")
      switch enable
      read -r off _ <<<"$result"
    fi
  done
  sleep 1  # the sessions' statistics reach the cumulative views as they exit
  lifecycles=$(awk -v tps="$on" -v s="$seconds" 'BEGIN { printf "%d", tps * s }')
  # round, function, calls, total ms, self ms; and the lifecycles and rates of the round
  sql "select $round, p.proname, s.calls, s.total_time, s.self_time
       from pg_stat_user_functions s join pg_proc p on p.oid = s.funcid
       where p.pronamespace = current_schema()::regnamespace" | tr '|' '\t' >>"$dir/functions.tsv"
  printf '%s\tlifecycle\t%s\t%s\t%s\n' "$round" "$lifecycles" "$latency" "$on" >>"$dir/functions.tsv"
  printf '%s\tall-off\t0\t%s\t0\n' "$round" "$off" >>"$dir/functions.tsv"
  echo "bench: round $round: every trigger on $on lifecycles/s (latency $latency ms), off $off" >&2
done

# Which function each trigger runs.
sql "select p.proname, string_agg(c.relname || '.' || t.tgname, ', ' order by t.tgname)
     from pg_trigger t join pg_class c on c.oid = t.tgrelid join pg_proc p on p.oid = t.tgfoid
     where c.relnamespace = current_schema()::regnamespace and not t.tgisinternal
     group by p.proname" | tr '|' '\t' >"$dir/triggers.tsv"

awk -F'\t' -v rounds="$rounds" -v version="$version" -v seconds="$seconds" -v clients="$clients" \
  -v jsonl="$jsonl" '
  FNR == NR { fired_by[$1] = $2; next }
  $2 == "lifecycle" { n[$1] = $3; latency[$1] = $4; on[$1] = $5; next }
  $2 == "all-off" { off[$1] = $4; next }
  { calls[$2, $1] = $3; total[$2, $1] = $4; self[$2, $1] = $5; seen[$2] = 1 }
  function median(a, k,   i, j, t, s) {  # of a[1..k]
    for (i = 1; i <= k; i++) s[i] = a[i]
    for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (s[j] < s[i]) { t = s[i]; s[i] = s[j]; s[j] = t }
    return k % 2 ? s[(k + 1) / 2] : (s[k / 2] + s[k / 2 + 1]) / 2
  }
  function per(fn, field,   r, v) {  # µs per lifecycle, median over rounds
    for (r = 1; r <= rounds; r++) v[r] = (field == "total" ? total[fn, r] : self[fn, r]) * 1000 / n[r]
    return median(v, rounds)
  }
  END {
    for (r = 1; r <= rounds; r++) lat[r] = latency[r] * 1000
    lifecycle = median(lat, rounds)
    calls_total = per("replyd_claim", "total") + per("replyd_complete", "total")
    printf "| function (trigger) | calls per lifecycle | µs per lifecycle (median) | ÷ the two calls | ÷ latency |\n"
    printf "|---|---:|---:|---:|---:|\n"
    for (fn in seen) if (fn in fired_by) {
      c = calls[fn, 1] / n[1]
      us = per(fn, "total")
      printf "| %s (%s) | %.2f | %.1f | %.3f | %.3f |\n", fn, fired_by[fn], c, us, us / calls_total, us / lifecycle
      triggers_us += us
    }
    printf "| every trigger | | %.1f | %.3f | %.3f |\n", triggers_us, triggers_us / calls_total, triggers_us / lifecycle
    printf "| replyd_claim + replyd_complete (triggers inside them included) | 2 | %.1f | 1 | %.3f |\n", calls_total, calls_total / lifecycle
    printf "| pgbench latency per lifecycle (%d clients) | | %.1f | | 1 |\n\n", clients, lifecycle
    printf "| round | lifecycles/s, every trigger on | every trigger off | on ÷ off |\n|---:|---:|---:|---:|\n"
    for (r = 1; r <= rounds; r++) {
      printf "| %d | %.0f | %.0f | %.2f |\n", r, on[r], off[r], on[r] / off[r]
      printf "{\"bench\":\"triggers\",\"version\":\"%s\",\"round\":%d,\"seconds\":%s,\"clients\":%s,\"on\":%s,\"off\":%s,\"latency_ms\":%s,\"lifecycles\":%d}\n", \
        version, r, seconds, clients, on[r], off[r], latency[r], n[r] >>jsonl
    }
  }' "$dir/triggers.tsv" "$dir/functions.tsv"
