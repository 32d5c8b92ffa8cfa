#!/usr/bin/env bash
# make bench-duplicates: how long a partition's commit point stays behind once every task is
# done, when each task is published several times and copies are in flight together. Two
# workers, 3 partitions, mock at 100 ms, the default 30 s lease. Prints the commit lag: the
# time from the last task's finished_at (database clock) to the moment every record of the
# topic is committed past (`replyd check`, polled every 0.2 s). Same machine, same clock.
#
#   deploy/bench-duplicates.sh [TASKS] [COPIES]
# WORKER_BIN=path runs the workers from another build (e.g. an older one) for comparison; the
# produce and check commands always come from this build.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tasks=${1:-300}
copies=${2:-3}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
worker_bin=${WORKER_BIN:-$bin}

id="dup-$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/bench/$id"
mkdir -p "$dir"
start_mock "$dir/mock" --latency-ms 100
db_url=$(schema_url "bench_$id")
topic="bench-$id"
for w in w1 w2; do
  write_settings "$dir/$w.toml" kafka.session_timeout_ms=10000 "worker.worker_id=\"$w\"" \
    worker.drain_timeout_ms=5000 worker.commit_interval_ms=200
done
"$lab" produce --config "$dir/w1.toml" --create-partitions 3 --count 0 >/dev/null
for w in w1 w2; do
  RUST_LOG=info,replyd::telemetry=debug "$worker_bin" worker --config "$dir/$w.toml" 2>"$dir/$w.log" &
  pids+=($!)
done
wait_until_assigned 60 "$dir/w1.log" "$dir/w2.log"
"$lab" produce --config "$dir/w1.toml" --count "$tasks" --copies "$copies" --conversations 30 >/dev/null

deadline=$(( $(date +%s) + 300 ))
until [ "$(terminal_count "$db_url")" -ge "$tasks" ]; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: tasks did not finish" >&2; exit 1; }
  sleep 0.2
done
until "$bin" check --config "$dir/w1.toml" --json | grep -q '"uncommitted_records":0,'; do
  [ "$(date +%s)" -lt "$deadline" ] || { echo "bench: offsets were not committed" >&2; exit 1; }
  sleep 0.2
done
committed_at=$(date +%s.%N)
last_done=$(psql -qtA "$db_url" -c "select extract(epoch from max(finished_at)) from reply_tasks")
parked=$(cat "$dir"/w*.log | grep -c 'leased_by_other' || true)
awk -v c="$committed_at" -v d="$last_done" -v p="$parked" -v n="$tasks" -v k="$copies" 'BEGIN {
  printf "tasks=%d copies=%d leased_by_other_claims=%s commit_lag_after_last_task_s=%.2f\n", n, k, p, c - d
}'
