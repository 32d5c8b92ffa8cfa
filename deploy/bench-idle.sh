#!/usr/bin/env bash
# What an idle worker costs: one `replyd worker` joined to an empty 6-partition topic, nothing to
# read, for SECONDS after it has settled. Prints the share of one core it used, and each of its
# threads' share (librdkafka's, the runtime's, rdkafka's polling threads), from /proc; run it for
# two builds one after the other (REPLYD_BIN) to compare them.
#
# Usage: deploy/bench-idle.sh [seconds] [runs]   (default: 60 3)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${1:-60}
runs=${2:-3}

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/idle-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
clk_tck=$(getconf CLK_TCK)

# ticks FILE...: user + system clock ticks of each /proc stat file given, summed.
ticks() {
  cat "$@" 2>/dev/null | awk '{ s += $14 + $15 } END { print s + 0 }'
}

# threads PID: "name ticks" for each thread of PID, one a line (the name's spaces as _).
threads() {
  local task name
  for task in /proc/"$1"/task/*; do
    name=$(tr ' ' _ <"$task/comm")
    echo "$name $(ticks "$task/stat")"
  done
}

for run in $(seq 1 "$runs"); do
  id="idle-$run-$$"
  start_mock "$dir/mock-$id" --latency-ms 0
  db_url=$(schema_url "bench_$id")
  schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
  topic="bench-$id"
  write_settings "$dir/$id.toml" "worker.worker_id=\"$id\""
  "$bin" migrate --config "$dir/$id.toml" 2>"$dir/$id-migrate.log"
  "$bin" topics ensure --config "$dir/$id.toml" --partitions 6 >/dev/null 2>"$dir/$id-topics.log"
  "$bin" worker --config "$dir/$id.toml" 2>"$dir/$id.log" &
  worker=$!
  pids+=("$worker")
  wait_until_assigned 60 "$dir/$id.log"
  # Settled: the group formed, the first statistics and metadata refreshes done.
  sleep 5
  threads "$worker" | sort >"$dir/$id.before"
  before=$(ticks "/proc/$worker/stat")
  sleep "$seconds"
  after=$(ticks "/proc/$worker/stat")
  threads "$worker" | sort >"$dir/$id.after"
  awk -v t="$clk_tck" -v s="$seconds" -v a="$before" -v b="$after" -v r="$run" \
    'BEGIN { printf "run %d: %.2f %% of a core\n", r, (b - a) / t / s * 100 }'
  # Threads of one name (librdkafka's broker threads) summed; the busiest first.
  join <(awk '{ n[$1] += $2 } END { for (k in n) print k, n[k] }' "$dir/$id.before" | sort) \
    <(awk '{ n[$1] += $2 } END { for (k in n) print k, n[k] }' "$dir/$id.after" | sort) |
    awk -v t="$clk_tck" -v s="$seconds" '{ d = $3 - $2; if (d > 0) printf "  %-16s %.2f %%\n", $1, d / t / s * 100 }' |
    sort -k2 -rn
  kill -TERM "$worker"
  wait "$worker" || true
  kill -TERM "$mock_pid"
  wait "$mock_pid" || true
  psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true
done
