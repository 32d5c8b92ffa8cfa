#!/usr/bin/env bash
# Benchmark P8 (live replies): what forwarding a reply's text as the provider writes it buys a
# user, and what it costs the database and the API. Simulated browsers (`replyd-lab browsers`,
# no lost answers, double clicks or regenerates) press Send against `replyd api`, the outbox
# relay and one worker, and follow each task over Server-Sent Events to "completed", timing
# the first `delta` event (first text) and the end. Each run does it twice, in its own
# database each time: live text on (`worker.live_text_interval_ms=75`, the default) and off
# (`=0`, the baseline: the worker still streams from the provider but forwards nothing), in
# alternating order from run to run.
#
# The mock paces its answers like a hosted chat model: 300 ms to the first token, then 12
# characters (about three tokens) every 20 ms, about 150 tokens/s; a reply of reply_chars
# characters (1,200: about 300 tokens, an ordinary chat answer) then takes about 2 s after
# its first token. That is the wait live text is for: with a reply written in a few
# milliseconds there would be nothing to forward.
#
# Per completed reply, for each variant:
#   - statements: PostgreSQL's own count of top-level statements in the variant's database
#     (pg_stat_statements, summed over its dbid), from 1.5 s after the processes are up to
#     1.5 s after they exit;
#   - transactions: pg_stat_database.xact_commit + xact_rollback of that database, the same
#     span (an idle session reports its count late, so a few of the start-up's may be in it);
#   - notifications: what a session listening on replyd's channels heard over the presses
#     (status changes, rounds of live text, outbox rows), each payload one entry of the
#     server's queue that every listening session reads;
#   - pieces and bytes: the worker's replyd_live_text_pieces_total{outcome="written"} and
#     replyd_live_text_bytes_total;
#   - CPU: utime + stime from /proc/<pid>/stat of the API, of the worker, and of the
#     database's sessions of the variant's database (the backends pg_stat_activity lists),
#     over the presses (start-up and shutdown left out).
# A dedicated database, not a schema of the shared one: its counters hold this variant's work
# only, and the notifications of anything else on the cluster do not reach its listeners.
#
# At scale (the chat product: many streams, several replicas): BENCH_APIS=N runs N API
# processes and BENCH_WORKERS=M workers (on BENCH_PARTITIONS partitions, 4 per worker unless
# set; each worker's window fits its share of the presses at once), the presses spread over
# the APIs and each followed on the API it was sent to; CPU figures are then the sums over
# the processes of a kind. Every run also reports, over the presses' wall time, pieces and
# PostgreSQL transactions per second.
#
# Usage: deploy/bench-live.sh [reply_chars] [presses] [concurrency] [runs]
#        (default: 1200 200 8 3)
# Writes the table to stdout and one JSON line per run to target/bench/live.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
reply_chars=${1:-1200}
presses=${2:-200}
concurrency=${3:-8}
runs=${4:-3}
latency_ms=300
chunk_chars=12
chunk_interval_ms=20
interval_on=75
apis=${BENCH_APIS:-1}
workers=${BENCH_WORKERS:-1}
if [ "$workers" -gt 1 ]; then partitions=${BENCH_PARTITIONS:-$(( workers * 4 ))}; else partitions=${BENCH_PARTITIONS:-1}; fi
# Each worker's window holds its share of the presses at once (the default 256 when that is
# less).
window=$(( (concurrency + workers - 1) / workers ))
[ "$window" -ge 256 ] || window=256

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/live-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
jsonl="$root/target/bench/live.jsonl"
clk_tck=$(getconf CLK_TCK)

# The bench reads the counters from the shared database, so its own queries are not counted.
q() {
  psql -qtAX "$DATABASE_URL" -c "$1"
}
q "create extension if not exists pg_stat_statements" >/dev/null 2>&1 || {
  echo "pg_stat_statements is not loaded (deploy/infra.sh preloads it; restart the cluster: make infra-down infra-up)" >&2
  exit 1
}

# cpu_of PID...: the processes' CPU seconds so far, summed.
cpu_of() {
  local pid sum=0
  for pid in "$@"; do sum=$(awk -v a="$sum" -v b="$(cpu_s "$pid")" 'BEGIN { print a + b }'); done
  echo "$sum"
}

# cpu_s PID: the process's CPU seconds so far (user + system).
cpu_s() {
  awk -v t="$clk_tck" '{ print ($14 + $15) / t }' "/proc/$1/stat" 2>/dev/null || echo 0
}

# db_cpu DATABASE: "pid seconds" of each session of DATABASE.
db_cpu() {
  local pid
  for pid in $(q "select pid from pg_stat_activity where datname = '$1'"); do
    echo "$pid $(cpu_s "$pid")"
  done
}

# counters DATABASE: its statements (pg_stat_statements) and transactions (pg_stat_database).
counters() {
  q "select (select coalesce(sum(calls), 0) from pg_stat_statements
              where dbid = (select oid from pg_database where datname = '$1')),
            (select xact_commit + xact_rollback from pg_stat_database where datname = '$1')" | tr '|' ' '
}

# scrape LOG FILE: the /metrics page of the process whose log is LOG, into FILE.
scrape() {
  local addr
  addr=$(sed -n 's/.*serving \/metrics.*addr=\([0-9.:]*\).*/\1/p' "$1" | tail -n 1)
  exec 3<>"/dev/tcp/${addr%:*}/${addr##*:}"
  printf 'GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n' >&3
  tr -d '\r' <&3 >"$2"
  exec 3<&-
}

# sum_metric FILE NAME [LABEL]: the sum of NAME's samples in FILE (those with LABEL, e.g.
# outcome="written"); 0 when there are none.
sum_metric() {
  awk -v name="$2" -v label="${3:-}" '
    { after = substr($1, length(name) + 1, 1) }
    index($1, name) == 1 && (after == "" || after == "{") && index($1, label) > 0 { s += $NF }
    END { printf "%.0f\n", s }' "$1"
}

# field NAME LINE: the number after NAME= in a summary line of the browsers.
field() {
  echo "$2" | sed -n "s/.* $1=\([0-9]*\).*/\1/p"
}

# variant RUN NAME INTERVAL_MS: one pass of the presses; appends its figures to $dir/results.
variant() {
  local run=$1 name=$2 interval=$3
  local id="live-$name-r$run-$$"
  local db
  db=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
  q "create database $db" >/dev/null
  local base=${DATABASE_URL%%\?*} query=""
  case "$DATABASE_URL" in *\?*) query="?${DATABASE_URL#*\?}" ;; esac
  db_url="${base%/*}/$db$query"
  topic="bench-$id"
  start_mock "$dir/$id-mock" --latency-ms "$latency_ms" --stream-chunk-chars "$chunk_chars" \
    --stream-chunk-interval-ms "$chunk_interval_ms"
  # One key presses for every simulated browser here: the per-key limit is not what this runs.
  local part parts=(relay)
  for i in $(seq 1 "$apis"); do parts+=("api$i"); done
  for i in $(seq 1 "$workers"); do parts+=("w$i"); done
  for part in "${parts[@]}"; do
    write_settings "$dir/$id-$part.toml" database.pool_size=8 kafka.session_timeout_ms=10000 \
      "worker.worker_id=\"$id-$part\"" worker.drain_timeout_ms=5000 \
      worker.commit_interval_ms=200 api.rate_limit_per_second=0 relay.poll_interval_ms=500 \
      "worker.global_window=$window" "worker.partition_window=$window" \
      provider.stream=true "worker.live_text_interval_ms=$interval"
  done
  "$bin" migrate --config "$dir/$id-api1.toml" 2>"$dir/$id-migrate.log"
  "$bin" workspace create bench --config "$dir/$id-api1.toml" >/dev/null
  key=$("$bin" api-key create --workspace bench --config "$dir/$id-api1.toml" 2>/dev/null)
  "$lab" produce --config "$dir/$id-api1.toml" --create-partitions "$partitions" --count 0 >/dev/null
  local started=() api_pids=() worker_pids=() worker_logs=() api_logs=() urls=()
  for i in $(seq 1 "$apis"); do
    "$bin" api --config "$dir/$id-api$i.toml" 2>"$dir/$id-api$i.log" &
    api_pids+=($!)
    api_logs+=("$dir/$id-api$i.log")
  done
  "$bin" relay --config "$dir/$id-relay.toml" 2>"$dir/$id-relay.log" &
  started+=($!)
  for i in $(seq 1 "$workers"); do
    "$bin" worker --config "$dir/$id-w$i.toml" 2>"$dir/$id-w$i.log" &
    worker_pids+=($!)
    worker_logs+=("$dir/$id-w$i.log")
  done
  started+=("${api_pids[@]}" "${worker_pids[@]}")
  pids+=("${started[@]}")
  wait_until_assigned 60 "${worker_logs[@]}"
  local log
  for log in "${api_logs[@]}"; do urls+=("http://$(api_addr "$log")"); done

  # Counters from here: the start-up's work is done (its idle sessions flush their counts).
  sleep 1.5
  read -r st0 tx0 < <(counters "$db")
  db_cpu "$db" >"$dir/$id-dbcpu0"
  local api0 w0 t0 t1
  api0=$(cpu_of "${api_pids[@]}")
  w0=$(cpu_of "${worker_pids[@]}")
  # A session that counts what replyd notifies (psql prints what it heard after each command:
  # one empty command every 0.2 s; the loop ends at its next write once psql is stopped).
  { echo "LISTEN replyd_task_status; LISTEN replyd_live_pieces; LISTEN replyd_live; LISTEN replyd_outbox;"
    while sleep 0.2; do echo ";"; done; } | psql -qtA "$db_url" >"$dir/$id.heard" 2>&1 &
  local heard=$!
  pids+=("$heard")
  sleep 0.5
  t0=$(date +%s.%N)
  REPLYD_API_KEY=$key "$lab" browsers --api "$(IFS=,; echo "${urls[*]}")" --presses "$presses" \
    --concurrency "$concurrency" --lose-share 0 --double-click-share 0 --regenerate-share 0 \
    --reply-chars "$reply_chars" --press-limit-s 300 --summary \
    >"$dir/$id-browsers.txt" 2>"$dir/$id-browsers.log"
  t1=$(date +%s.%N)
  sleep 0.5
  kill -TERM "$heard" 2>/dev/null || true
  wait "$heard" 2>/dev/null || true
  local notifications
  notifications=$(grep -c '^Asynchronous notification' "$dir/$id.heard" || true)
  local api1 w1 dbcpu line
  api1=$(cpu_of "${api_pids[@]}")
  w1=$(cpu_of "${worker_pids[@]}")
  db_cpu "$db" >"$dir/$id-dbcpu1"
  dbcpu=$(awk 'NR == FNR { before[$1] = $2; next } { s += $2 - before[$1] } END { print s + 0 }' \
    "$dir/$id-dbcpu0" "$dir/$id-dbcpu1")
  for i in $(seq 1 "$workers"); do scrape "$dir/$id-w$i.log" "$dir/$id-w$i.metrics"; done
  for i in $(seq 1 "$apis"); do scrape "$dir/$id-api$i.log" "$dir/$id-api$i.metrics"; done
  line=$(cat "$dir/$id-browsers.txt")
  [ "$(field unfinished "$line")" -eq 0 ] || { echo "bench: presses did not finish: $line" >&2; exit 1; }
  local pid
  for pid in "${started[@]}"; do kill -TERM "$pid"; wait "$pid" || true; done
  kill -TERM "$mock_pid"; wait "$mock_pid" || true
  # Exited sessions have flushed their counters; the server publishes them within a second.
  sleep 1.5
  read -r st1 tx1 < <(counters "$db")
  q "select calls, regexp_replace(left(query, 100), '\s+', ' ', 'g') from pg_stat_statements
      where dbid = (select oid from pg_database where datname = '$db') order by calls desc limit 12" \
    >"$dir/$id.statements"
  local completed attempts pieces bytes api_deltas streams
  read -r completed attempts < <(psql -qtAX "$db_url" -F ' ' -c "
    select (select count(*) from reply_tasks where status = 'completed'),
           (select count(*) from reply_attempts)")
  pieces=$(cat "$dir/$id"-w*.metrics | sum_metric /dev/stdin replyd_live_text_pieces_total 'outcome="written"')
  bytes=$(cat "$dir/$id"-w*.metrics | sum_metric /dev/stdin replyd_live_text_bytes_total)
  api_deltas=$(cat "$dir/$id"-api*.metrics | sum_metric /dev/stdin replyd_api_live_events_total 'event="delta"')
  streams=$(cat "$dir/$id"-w*.metrics | grep '^replyd_provider_streams_total{' | tr '\n' ' ' || true)
  # The path before the provider, from the database's clock and each task's intake: handed
  # to Kafka (the relay) and claimed by the worker (p50 p99 of each, ms). The first text
  # comes after it, the time to the first token and one interval.
  local stages
  stages=$(psql -qtAX "$db_url" -F ' ' -c "
    with s as (
      select extract(epoch from o.published_at - o.created_at) * 1000 as published,
             extract(epoch from a.claimed_at - o.created_at) * 1000 as claimed
        from outbox o join reply_attempts a on a.task_id = o.task_id and a.assignment_version = 1)
    select $(for c in published claimed; do for p in 0.5 0.99; do
               printf 'round(percentile_cont(%s) within group (order by %s)::numeric),' "$p" "$c"
             done; done | sed 's/,$//') from s")
  q "drop database $db with (force)" >/dev/null 2>&1 || true

  echo "$run $name $interval $(field first_text_ms_p50 "$line") $(field first_text_ms_p99 "$line") $(field e2e_ms_p50 "$line") $(field e2e_ms_p99 "$line")" \
    "$completed $attempts $(field streamed "$line") $(( st1 - st0 )) $(( tx1 - tx0 )) $pieces $bytes" \
    "$(awk -v a="$api0" -v b="$api1" 'BEGIN { print b - a }')" \
    "$(awk -v a="$w0" -v b="$w1" 'BEGIN { print b - a }')" "$dbcpu" \
    "$api_deltas $(field deltas "$line") $(field deltas_out_of_order "$line") $(field streamed_text_mismatches "$line") $stages" \
    "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }') $notifications" >>"$dir/results"
  echo "bench: run $run, live text $name: $line" >&2
  echo "bench:   worker: $streams; pieces written $pieces, API delta events $api_deltas; attempts $attempts for $completed completed" >&2
  echo "bench:   from intake, p50 p99 ms: published $(echo "$stages" | cut -d' ' -f1-2), claimed $(echo "$stages" | cut -d' ' -f3-4)" >&2
  sed 's/^/bench:   statements: /' "$dir/$id.statements" | head -n 6 >&2
  [ "$(field deltas_out_of_order "$line")" -eq 0 ] && [ "$(field streamed_text_mismatches "$line")" -eq 0 ] \
    || echo "bench: WARNING: live text out of order or not the start of its reply: $line" >&2
}

: >"$dir/results"
for run in $(seq 1 "$runs"); do
  if [ $(( run % 2 )) -eq 1 ]; then
    variant "$run" on "$interval_on"
    variant "$run" off 0
  else
    variant "$run" off 0
    variant "$run" on "$interval_on"
  fi
done

# $dir/results, a line per run and variant: 1 run, 2 variant, 3 interval, 4 first text p50, 5 p99, 6 completed p50, 7 p99,
# 8 completed, 9 attempts, 10 streamed, 11 statements, 12 transactions, 13 pieces, 14 bytes,
# 15 API CPU s, 16 worker CPU s, 17 database CPU s, 18 API deltas, 19 browsers' deltas,
# 20 out of order, 21 mismatches, 22-25 published and claimed from intake (p50, p99),
# 26 the presses' wall time, s, 27 notifications heard.
# $dir/per-reply, the same per completed reply: 1 run, 2 variant, 3 first text p50, 4 p99, 5 completed p50, 6 p99, 7 streamed,
# 8 first text ÷ completed, 9 statements, 10 transactions, 11 notifications, 12 pieces,
# 13 bytes, 14 API CPU ms, 15 worker CPU ms, 16 database CPU ms, 17 out of order,
# 18 mismatches, 19 API deltas, 20 browsers' deltas, 21-24 published and claimed, 25 pieces
# per second and 26 transactions per second over the presses' wall time.
awk -v presses="$presses" '{
  n = $8
  printf "%s %s %d %d %d %d %d %.4f %.2f %.2f %.2f %.2f %.1f %.3f %.3f %.3f %d %d %d %d %d %d %d %d %.0f %.0f\n",
    $1, $2, $4, $5, $6, $7, $10, ($2 == "on" ? $4 / $6 : 0), $11 / n, $12 / n,
    $27 / n, $13 / n, $14 / n, $15 * 1000 / n, $16 * 1000 / n, $17 * 1000 / n,
    $20, $21, $18, $19, $22, $23, $24, $25, $13 / $26, $12 / $26
}' "$dir/results" >"$dir/per-reply"
# Per run: on ÷ off of completed p50, statements, transactions, notifications, API, worker
# and database CPU per reply.
awk '{ for (i = 3; i <= NF; i++) v[$1, $2, i] = $i; runs[$1] = 1 }
  END { for (r in runs) printf "%s %.3f %.2f %.2f %.2f %.2f %.2f %.2f\n", r,
    v[r, "on", 5] / v[r, "off", 5], v[r, "on", 9] / v[r, "off", 9], v[r, "on", 10] / v[r, "off", 10],
    v[r, "on", 11] / v[r, "off", 11], v[r, "on", 14] / v[r, "off", 14],
    v[r, "on", 15] / v[r, "off", 15], v[r, "on", 16] / v[r, "off", 16] }' "$dir/per-reply" \
  | sort -n >"$dir/ratios"

# col VARIANT N: "median min max" of column N of the variant's per-reply lines.
col() {
  awk -v v="$1" -v c="$2" '$2 == v { print $c }' "$dir/per-reply" | stats
}
ratio() {
  cut -d' ' -f"$1" "$dir/ratios" | stats
}

for run in $(seq 1 "$runs"); do
  awk -v run="$run" -v on_ms="$interval_on" -v chars="$reply_chars" -v presses="$presses" -v conc="$concurrency" \
      -v apis="$apis" -v workers="$workers" -v parts="$partitions" \
      -v lat="$latency_ms" -v cc="$chunk_chars" -v ci="$chunk_interval_ms" '
    function obj(v,   s) {
      s = sprintf("{\"interval_ms\":%d,\"first_text_ms_p50\":%d,\"first_text_ms_p99\":%d,\"e2e_ms_p50\":%d,\"e2e_ms_p99\":%d,\"streamed\":%d,", iv[v], p[v, 3], p[v, 4], p[v, 5], p[v, 6], p[v, 7])
      s = s sprintf("\"statements_per_reply\":%s,\"transactions_per_reply\":%s,\"notifications_per_reply\":%s,\"pieces_per_reply\":%s,\"bytes_per_reply\":%s,", p[v, 9], p[v, 10], p[v, 11], p[v, 12], p[v, 13])
      return s sprintf("\"api_cpu_ms_per_reply\":%s,\"worker_cpu_ms_per_reply\":%s,\"db_cpu_ms_per_reply\":%s,\"deltas_out_of_order\":%d,\"streamed_text_mismatches\":%d,\"deltas_sent\":%d,\"deltas_received\":%d,\"from_intake_ms\":{\"published\":[%d,%d],\"claimed\":[%d,%d]},\"pieces_per_s\":%d,\"transactions_per_s\":%d}", p[v, 14], p[v, 15], p[v, 16], p[v, 17], p[v, 18], p[v, 19], p[v, 20], p[v, 21], p[v, 22], p[v, 23], p[v, 24], p[v, 25], p[v, 26])
    }
    FILENAME ~ /per-reply$/ && $1 == run { for (i = 1; i <= NF; i++) p[$2, i] = $i; iv[$2] = ($2 == "on") ? on_ms : 0 }
    FILENAME ~ /ratios$/ && $1 == run { split($0, r, " ") }
    END {
      printf "{\"bench\":\"live\",\"apis\":%d,\"workers\":%d,\"partitions\":%d,\"reply_chars\":%d,\"presses\":%d,\"concurrency\":%d,\"run\":%d,", apis, workers, parts, chars, presses, conc, run
      printf "\"mock\":{\"latency_ms\":%d,\"stream_chunk_chars\":%d,\"stream_chunk_interval_ms\":%d},", lat, cc, ci
      printf "\"on\":%s,\"off\":%s,", obj("on"), obj("off")
      printf "\"first_text_over_completed_p50\":%s,\"on_over_off\":{\"e2e_ms_p50\":%s,\"statements_per_reply\":%s,\"transactions_per_reply\":%s,\"notifications_per_reply\":%s,\"api_cpu_per_reply\":%s,\"worker_cpu_per_reply\":%s,\"db_cpu_per_reply\":%s}}\n",
        p["on", 8], r[2], r[3], r[4], r[5], r[6], r[7], r[8]
    }' "$dir/per-reply" "$dir/ratios" >>"$jsonl"
done

echo "| live text | first text p50, ms (median, min–max) | p99 (median) | completed p50, ms (median, min–max) | p99 (median) | first text ÷ completed, p50 (median, min–max) | statements / reply | transactions / reply | notifications / reply | pieces / reply | bytes / reply | API CPU ms / reply (median, min–max) | worker CPU ms / reply | database CPU ms / reply |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for v in on off; do
  read -r ft_m ft_lo ft_hi < <(col "$v" 3)
  read -r ft99 _ _ < <(col "$v" 4)
  read -r e_m e_lo e_hi < <(col "$v" 5)
  read -r e99 _ _ < <(col "$v" 6)
  read -r fr_m fr_lo fr_hi < <(col "$v" 8)
  read -r st _ _ < <(col "$v" 9)
  read -r tx _ _ < <(col "$v" 10)
  read -r no _ _ < <(col "$v" 11)
  read -r pc _ _ < <(col "$v" 12)
  read -r by _ _ < <(col "$v" 13)
  read -r ac_m ac_lo ac_hi < <(col "$v" 14)
  read -r wc _ _ < <(col "$v" 15)
  read -r dc _ _ < <(col "$v" 16)
  if [ "$v" = on ]; then
    label="on, ${interval_on} ms"
    first=$(printf '%.0f (%.0f–%.0f) | %.0f' "$ft_m" "$ft_lo" "$ft_hi" "$ft99")
    share=$(printf '**%.2f** (%.2f–%.2f)' "$fr_m" "$fr_lo" "$fr_hi")
  else
    label="off (baseline)"
    first="– | –"
    share="–"
  fi
  printf '| %s | %s | %.0f (%.0f–%.0f) | %.0f | %s | %.2f | %.2f | %.2f | %.1f | %.0f | %.2f (%.2f–%.2f) | %.2f | %.2f |\n' \
    "$label" "$first" "$e_m" "$e_lo" "$e_hi" "$e99" "$share" "$st" "$tx" "$no" "$pc" "$by" \
    "$ac_m" "$ac_lo" "$ac_hi" "$wc" "$dc"
done
read -r re_m re_lo re_hi < <(ratio 2)
read -r rs_m rs_lo rs_hi < <(ratio 3)
read -r rt_m rt_lo rt_hi < <(ratio 4)
read -r rn_m rn_lo rn_hi < <(ratio 5)
read -r ra_m ra_lo ra_hi < <(ratio 6)
read -r rw_m rw_lo rw_hi < <(ratio 7)
read -r rd_m rd_lo rd_hi < <(ratio 8)
printf '| on ÷ off (median, min–max) | | | %.2f (%.2f–%.2f) | | | **%.2f** (%.2f–%.2f) | %.2f (%.2f–%.2f) | %.2f (%.2f–%.2f) | | | **%.2f** (%.2f–%.2f) | %.2f (%.2f–%.2f) | %.2f (%.2f–%.2f) |\n' \
  "$re_m" "$re_lo" "$re_hi" "$rs_m" "$rs_lo" "$rs_hi" "$rt_m" "$rt_lo" "$rt_hi" "$rn_m" "$rn_lo" "$rn_hi" \
  "$ra_m" "$ra_lo" "$ra_hi" "$rw_m" "$rw_lo" "$rw_hi" "$rd_m" "$rd_lo" "$rd_hi"
echo "reply of $reply_chars characters, $presses presses, $concurrency at once, $runs runs; mock: ${latency_ms} ms to the first token, $chunk_chars characters every $chunk_interval_ms ms" >&2
