#!/usr/bin/env bash
# make bench-fairness: is a small workspace stuck behind a big one's burst (I10)? Two workers
# with their defaults and the provider's limits declared (`[capacity]`: 3,000 requests a minute,
# 64 at once) work a 6-partition topic against the mock at 200 ms enforcing the same limits
# (anything over them is answered 429 at once, no work done).
#
#   deploy/bench-fairness.sh [SHAPE]
#
# SHAPE:
#   burst   (default) workspace A publishes 2,000 tasks at once; 3 s later workspace B
#           publishes 20. B's 20 calls need 0.4 s of the provider's capacity.
#   skewed  10 workspaces publish at once, with skewed backlogs: workspace k publishes
#           400 / (k + 1) tasks (400, 200, 133, ... 40).
#   weighted  3 workspaces publish 900 tasks each at once; ws-heavy has weight 3 (`replyd
#           workspace share`), ws-1 and ws-2 weight 1: while all are backlogged ws-heavy should
#           get 3/5 of the calls and the others 1/5 each.
#
# When every task is terminal (or after BENCH_LIMIT_S, 600 s) it prints, per workspace, its
# weight, tasks, failed, the time from its publish to completed (p50, p99, max) and its share
# of the completions while every workspace still had work waiting (from the first publish to
# the first workspace's last completion); then the run's replies per second against the limit
# (50/s), the requests the mock refused, and Jain's fairness index over that span of the
# workspaces' completions, each divided by its weight (1 is a perfect split by weight, 1/n one
# workspace taking everything). One JSON line per run goes to target/bench/fairness.jsonl.
# REPLYD_BIN runs an already built binary (see deploy/lib.sh); WORKER_TOML adds settings to the
# workers' file; BENCH_LABEL names the binary in the JSON line.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
shape=${1:-burst}
limit_s=${BENCH_LIMIT_S:-600}
rpm=3000
at_once=64
case "$shape" in
  burst | skewed | weighted) ;;
  *)
    echo "bench-fairness: unknown shape '$shape' (burst, skewed or weighted)" >&2
    exit 2
    ;;
esac

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare

id="fair-$shape-$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/bench/$id"
mkdir -p "$dir"
{
  printf '[capacity]\nrequests_per_minute = %s\nmax_concurrent = %s\n' "$rpm" "$at_once"
  printf '%s\n' "${WORKER_TOML:-}"
} >"$dir/worker.toml"

start_mock "$dir/mock" --latency-ms 200 --limit-rpm "$rpm" --limit-concurrent "$at_once" --seed 7
mock=$mock_pid
start_two_workers "$dir" "$id"

# The workspaces' weights (the workers have migrated the schema by now). Workers read the
# weights every 10 s: wait past one read before publishing.
: >"$dir/weights"
if [ "$shape" = weighted ]; then
  for ws in ws-heavy ws-1 ws-2; do
    "$bin" workspace create "$ws" --config "$dir/worker.toml" >/dev/null
  done
  "$bin" workspace share ws-heavy --weight 3 --config "$dir/worker.toml" >/dev/null
  echo "ws-heavy 3" >"$dir/weights"
  sleep 11
fi

# publish WORKSPACE COUNT: publishes COUNT tasks of WORKSPACE (100 conversations, spread over
# the partitions) and records when it began.
: >"$dir/published"
publish() {
  echo "$1 $(date +%s.%N)" >>"$dir/published"
  "$lab" produce --config "$dir/worker.toml" --workspace "$1" --count "$2" --conversations 100 >/dev/null
}
tasks=0
case "$shape" in
  burst)
    publish ws-a 2000 &
    publishers=($!)
    sleep 3
    publish ws-b 20
    tasks=2020
    ;;
  skewed)
    publishers=()
    for k in $(seq 0 9); do
      n=$(( 400 / (k + 1) ))
      publish "ws-$k" "$n" &
      publishers+=($!)
      tasks=$(( tasks + n ))
    done
    ;;
  weighted)
    publishers=()
    for ws in ws-heavy ws-1 ws-2; do
      publish "$ws" 900 &
      publishers+=($!)
    done
    tasks=2700
    ;;
esac

# Only the publishers: the workers run on in the background.
for pid in "${publishers[@]}"; do wait "$pid"; done
deadline=$(( $(date +%s) + limit_s ))
until [ "$(terminal_count "$db_url")" -ge "$tasks" ]; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "bench-fairness: not every task was terminal within ${limit_s}s" >&2
    break
  fi
  sleep 0.5
done

psql -qtA -F ' ' "$db_url" -c \
  "select workspace_id, status, extract(epoch from finished_at) from reply_tasks" >"$dir/tasks"
mock_addr=${mock_url#http://}
stats=$(exec 3<>"/dev/tcp/${mock_addr%:*}/${mock_addr##*:}" && printf 'GET /stats HTTP/1.0\r\n\r\n' >&3 && cat <&3)
for pid in "${workers[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
for pid in "${workers[@]}"; do wait "$pid" 2>/dev/null || true; done
kill -TERM "$mock" 2>/dev/null || true
wait "$mock" 2>/dev/null || true
echo "$stats" | tr -d '\r' | sed -n '/^{/p' >"$dir/mock-stats.json"

version=${BENCH_LABEL:-$(git rev-parse --short HEAD 2>/dev/null || echo replyd)}
python3 - "$dir" "$shape" "$tasks" "$rpm" "$version" <<'PY'
import json, sys
from collections import defaultdict
d, shape, tasks, rpm, version = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
weights = defaultdict(lambda: 1)
for line in open(f"{d}/weights"):
    ws, w = line.split()
    weights[ws] = int(w)
published = {}
for line in open(f"{d}/published"):
    ws, at = line.split()
    published[ws] = float(at)
ends = defaultdict(list)
failed = defaultdict(int)
for line in open(f"{d}/tasks"):
    parts = line.split()
    if len(parts) < 3:
        continue
    ws, status, end = parts[0], parts[1], float(parts[2])
    if status == "completed":
        ends[ws].append(end)
    elif status == "failed":
        failed[ws] += 1

def q(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))] if xs else None

first = min(published.values())
# Every workspace backlogged: up to the first workspace's last completion.
until = min(max(e) for e in ends.values()) if ends else first
done_by = {ws: sum(1 for e in es if e <= until) for ws, es in ends.items()}
shares = [done_by[ws] / weights[ws] for ws in done_by]
n, s, s2 = len(shares), sum(shares), sum(x * x for x in shares)
jain = (s * s) / (n * s2) if s2 else 1.0
stats = json.load(open(f"{d}/mock-stats.json"))
refused = stats["refused"]
refusals = refused["requests"] + refused["tokens"] + refused["concurrent"]
completed = sum(len(e) for e in ends.values())
last = max((max(e) for e in ends.values()), default=first)
wall = max(last - first, 0.001)
per = {}
for ws in sorted(published):
    lat = [e - published[ws] for e in ends[ws]]
    per[ws] = {
        "tasks": len(lat) + failed[ws],
        "failed": failed[ws],
        "p50_s": round(q(lat, 0.5), 2) if lat else None,
        "p99_s": round(q(lat, 0.99), 2) if lat else None,
        "max_s": round(max(lat), 2) if lat else None,
        "share_while_all_backlogged": round(done_by.get(ws, 0) / max(sum(done_by.values()), 1), 3),
    }
line = {
    "bench": "fairness",
    "shape": shape,
    "version": version,
    "tasks": tasks,
    "completed": completed,
    "replies_per_s": round(completed / wall, 1),
    "ratio_to_limit": round(completed / wall / (rpm / 60), 3),
    "refused": refusals,
    "jain_while_all_backlogged": round(jain, 3),
    "backlogged_s": round(until - first, 1),
    "workspaces": per,
    "weights": {ws: weights[ws] for ws in sorted(published)},
}
with open("target/bench/fairness.jsonl", "a") as out:
    out.write(json.dumps(line) + "\n")
print(f"bench-fairness: shape={shape} version={version}")
print("| workspace | weight | tasks | failed | publish to completed, p50 | p99 | max | share while all backlogged |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for ws, r in per.items():
    print(
        f"| {ws} | {weights[ws]} | {r['tasks']} | {r['failed']} | {r['p50_s']} s | {r['p99_s']} s | {r['max_s']} s "
        f"| {r['share_while_all_backlogged']} |"
    )
print(
    f"replies_per_s={line['replies_per_s']} ratio_to_limit={line['ratio_to_limit']} (limit {rpm // 60}/s) "
    f"refused={refusals}"
    + (
        f" jain_while_all_backlogged={line['jain_while_all_backlogged']} (over the first {line['backlogged_s']} s)"
        if shape != "burst"
        else ""
    )
)
PY
