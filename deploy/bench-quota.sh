#!/usr/bin/env bash
# make bench-quota: generation quotas under retries and provider faults, the whole chain.
# PRESSES simulated browsers press Send against a workspace whose limit is LIMIT per day; 20 %
# of them lose their first answer (a client timeout) and retry with the same key; the mock
# provider (background responses, 100 ms) loses 20 % of its answers after doing the work (an
# ambiguous fault: the worker must find the work again, not generate twice). The reservation
# TTL is short (40 s, with leases of 2 s and a refusal budget of 10 s: the shortest `config
# check` takes here, a task's retries and refusals plus the time its record may wait for
# redelivery), so the reconciler decides
# reservations while their work still runs, and settles those of tasks that failed while the
# provider may have done their work. Prints requests, admitted, 429s, charged (and of them
# charged for work whose outcome nobody could learn), released, expired, reconciler decisions,
# unsettled, generations and double charges (must be 0), read back from PostgreSQL and the
# mock's counters.
#
#   deploy/bench-quota.sh [PRESSES] [LIMIT]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
presses=${1:-1000}
limit=${2:-800}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare

id="quota-$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/bench/$id"
mkdir -p "$dir"
db_url=$(schema_url "bench_$id")
# The mock honours Idempotency-Key here (no real API documents it; off by default) so a lost
# create resent under its key finds its response, as in the figures of earlier runs.
start_mock "$dir/mock" --latency-ms 100 --drop-after-work-rate 0.2 --honour-idempotency-key true
topic="bench-$id"
partitions=6
# One key presses for every simulated browser here: the per-key limit is not what this runs.
for name in api w1 w2; do
  write_settings "$dir/$name.toml" "worker.worker_id=\"$name\"" \
    kafka.session_timeout_ms=10000 worker.lease_ms=2000 worker.renew_interval_ms=500 \
    worker.drain_timeout_ms=5000 worker.commit_interval_ms=200 \
    retry.base_delay_ms=100 retry.max_delay_ms=1000 retry.refusal_budget_ms=10000 \
    'provider.api="background_responses"' provider.request_timeout_ms=5000 \
    provider.poll_interval_ms=50 api.rate_limit_per_second=0 relay.poll_interval_ms=200 \
    quota.reservation_ttl_ms=40000
done
start_front_half "$dir/api.toml" bench "$dir"
"$bin" quota set --workspace bench --limit "$limit" --period 1d --config "$dir/api.toml" >/dev/null
for w in w1 w2; do
  "$bin" worker --config "$dir/$w.toml" 2>"$dir/$w.log" &
  pids+=($!)
done
wait_until_assigned 60 "$dir/w1.log" "$dir/w2.log"

echo "bench: $presses presses against a limit of $limit, 20 % lost answers, 20 % ambiguous provider faults" >&2
REPLYD_API_KEY=$key "$lab" browsers --api "http://$api" --presses "$presses" --concurrency 32 \
  --lose-share 0.2 --double-click-share 0 --regenerate-share 0 --press-limit-s 300 \
  >"$dir/browsers.json" 2>"$dir/browsers.log"

# Wait until every reservation is settled (the reconciler runs every 10 s in the relay).
deadline=$(( $(date +%s) + 300 ))
until [ "$(psql -qtA "$db_url" -c "select count(*) from quota_reservations where state = 'reserved'")" -eq 0 ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: reservations still open after 300 s" >&2; break; }
  sleep 1
done
for pid in "${pids[@]:1}"; do kill -TERM "$pid"; done
for pid in "${pids[@]:1}"; do wait "$pid" || true; done
pids=("${pids[0]}")

json_field() { sed -n "s/.*\"$2\":\\([0-9]*\\).*/\\1/p" "$1"; }
requests=$(json_field "$dir/browsers.json" requests)
refused=$(json_field "$dir/browsers.json" quota_refused)
unfinished=$(json_field "$dir/browsers.json" unfinished)
read -r admitted charged released expired open completed < <(psql -qtA -F ' ' "$db_url" -c \
  "select (select count(*) from reply_tasks),
          count(*) filter (where state = 'charged'), count(*) filter (where state = 'released'),
          count(*) filter (where state = 'expired'), count(*) filter (where state = 'reserved'),
          (select count(*) from reply_tasks where status = 'completed')
     from quota_reservations")
decisions=$(psql -qtA "$db_url" -c "select coalesce(string_agg(decision || ':' || n, ','), 'none') from (select decision, count(*) n from quota_decisions group by 1 order by 1) d")
used=$(psql -qtA "$db_url" -c "select used from quota_counters where workspace_id = 'bench'")
# Charged for a task that failed while the provider may have done its work (quota.charge_unresolved).
unresolved=$(psql -qtA "$db_url" -c "select count(*) from quota_reservations r join reply_tasks t using (task_id) where r.state = 'charged' and t.status = 'failed'")
double=$(( charged - completed - unresolved ))
check=$("$bin" check --config "$dir/api.toml" --mock-url "$mock_url" --summary) || {
  echo "bench: an invariant is broken:" >&2
  "$bin" check --config "$dir/api.toml" --mock-url "$mock_url" >&2 || true
  exit 1
}
generations=$(echo "$check" | sed -n 's/.*generations=\([0-9]*\).*/\1/p')
echo "bench: figures in $dir" >&2
echo "bench-quota: presses=$presses limit=$limit requests=$requests admitted=$admitted refused_429=$refused unfinished=$unfinished charged=$charged charged_unresolved=$unresolved released=$released expired=$expired unsettled=$open used=$used reconciler=$decisions generations=$generations double_charges=$double"
