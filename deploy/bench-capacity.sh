#!/usr/bin/env bash
# make bench-capacity: replyd against a provider that enforces its limits as the hosted LLM APIs
# do. TASKS (2,000) are published at once (`replyd-lab produce`) to a 6-partition topic; two workers
# with the default settings work them against the mock at 200 ms with `--limit-rpm 3000
# --limit-concurrent 64`: at most 50 requests in any second and 64 at once, anything over that
# answered 429 at once with OpenAI's body, its rate-limit headers and `retry-after: 1`, and no
# work done. When every task is terminal (or after BENCH_LIMIT_S, 900 s) it prints one line:
# tasks, completed, failed, replies per second over the run (publish to the last task's end)
# and its ratio to the limit (50/s), the requests the mock refused and their share of all the
# requests it got, generations, the most it admitted in a second and at once (never over the
# limits), and the wall time. The same line goes to target/bench/capacity.jsonl as JSON.
#
#   deploy/bench-capacity.sh [VARIANT] [TASKS]
#
# VARIANT:
#   plain     (default) the limits above
#   tpm       also `--limit-tpm $BENCH_TPM` (1,500,000: 25,000 tokens in any second), and
#             questions of 50 to 1,950 words (`produce --prompt-words`); a task costs its
#             prompt's words plus its 256 output tokens, about 1,260 on average, so the token
#             limit binds (about 20 tasks a second) before the request limit
#   adaptive  the limits above with nothing about them configured in replyd: the workers have
#             only the provider's own signals (429, retry-after, the headers) to go by.
#             WORKER_TOML is not applied.
#   retry-after  as adaptive, against a provider that reports no limit, as Azure OpenAI
#             deployments and gateways answer (`--limit-headers retry-after-only`): no
#             rate-limit headers, and a refusal's `retry-after` and `retry-after-ms` are all
#             the workers learn the limit from.
#
# WORKER_TOML (TOML text) or WORKER_TOML_FILE (a file) becomes each worker's settings file, so
# the same script measures the worker's capacity settings: e.g. the provider's limits declared
# to replyd. The run's own settings (database, Kafka, topic, group, worker id, provider URL,
# metrics port) come as REPLYD_* variables, which win over the file, so the fragment may use
# any table. REPLYD_BIN runs an already built binary (see deploy/lib.sh).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
variant=${1:-plain}
tasks=${2:-2000}
rpm=3000
at_once=64
tpm=${BENCH_TPM:-1500000}
prompt_words=${BENCH_PROMPT_WORDS:-50-1950}
latency_ms=200
limit_s=${BENCH_LIMIT_S:-900}

mock_limits=(--limit-rpm "$rpm" --limit-concurrent "$at_once")
produce_sizes=()
case "$variant" in
  plain | adaptive) ;;
  retry-after) mock_limits+=(--limit-headers retry-after-only) ;;
  tpm)
    mock_limits+=(--limit-tpm "$tpm")
    produce_sizes=(--prompt-words "$prompt_words")
    ;;
  *)
    echo "bench-capacity: unknown variant '$variant' (plain, tpm, adaptive or retry-after)" >&2
    exit 2
    ;;
esac

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare

id="cap-$variant-$(date +%Y%m%d%H%M%S)-$$"
dir="$root/target/bench/$id"
mkdir -p "$dir"
settings=defaults
: >"$dir/worker.toml"
if [ "$variant" != adaptive ] && [ "$variant" != retry-after ]; then
  if [ -n "${WORKER_TOML_FILE:-}" ]; then
    cp "$WORKER_TOML_FILE" "$dir/worker.toml"
    settings=$(basename "$WORKER_TOML_FILE")
  elif [ -n "${WORKER_TOML:-}" ]; then
    printf '%s\n' "$WORKER_TOML" >"$dir/worker.toml"
    settings=inline
  fi
fi

start_mock "$dir/mock" --latency-ms "$latency_ms" "${mock_limits[@]}" --seed 7
mock=$mock_pid
start_two_workers "$dir" "$id"

started=$(date +%s.%N)
"$lab" produce --config "$dir/worker.toml" --count "$tasks" \
  "${produce_sizes[@]}" >/dev/null
deadline=$(( $(date +%s) + limit_s ))
until [ "$(terminal_count "$db_url")" -ge "$tasks" ]; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "bench-capacity: not every task was terminal within ${limit_s}s" >&2
    break
  fi
  sleep 0.5
done

read -r completed failed last_end < <(psql -qtA -F ' ' "$db_url" -c \
  "select count(*) filter (where status = 'completed'), count(*) filter (where status = 'failed'),
          coalesce(extract(epoch from max(finished_at)), 0) from reply_tasks")
reasons=$(psql -qtA -F ' ' "$db_url" -c \
  "select count(*), left(regexp_replace(failure, '[0-9]+', 'N', 'g'), 90) from reply_tasks
   where status = 'failed' group by 2 order by 1 desc limit 3")
mock_addr=${mock_url#http://}
stats=$(exec 3<>"/dev/tcp/${mock_addr%:*}/${mock_addr##*:}" && printf 'GET /stats HTTP/1.0\r\n\r\n' >&3 && cat <&3)
for pid in "${workers[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
for pid in "${workers[@]}"; do wait "$pid" 2>/dev/null || true; done
kill -TERM "$mock" 2>/dev/null || true
wait "$mock" 2>/dev/null || true

echo "$stats" | tr -d '\r' | sed -n '/^{/p' >"$dir/mock-stats.json"
python3 - "$dir/mock-stats.json" "$variant" "$settings" "$tasks" "$completed" "$failed" \
  "$started" "$last_end" "$rpm" "$tpm" "$at_once" <<'PY'
import json, sys
path, variant, settings = sys.argv[1:4]
tasks, completed, failed = (int(x) for x in sys.argv[4:7])
started, last_end = float(sys.argv[7]), float(sys.argv[8])
rpm, tpm, at_once = (int(x) for x in sys.argv[9:12])
stats = json.load(open(path))
refused = stats["refused"]
refusals = refused["requests"] + refused["tokens"] + refused["concurrent"]
asked = stats["admitted"] + refusals
wall = max(last_end - started, 0.001)
limit_per_s = rpm / 60
line = {
    "bench": "capacity",
    "variant": variant,
    "settings": settings,
    "tasks": tasks,
    "completed": completed,
    "failed": failed,
    "unfinished": tasks - completed - failed,
    "replies_per_s": round(completed / wall, 1),
    "ratio_to_limit": round(completed / wall / limit_per_s, 3),
    "limit_per_s": limit_per_s,
    "requests": asked,
    "refused": refusals,
    "refused_share": round(refusals / asked, 3) if asked else 0.0,
    "refused_rpm": refused["requests"],
    "refused_tpm": refused["tokens"],
    "refused_concurrent": refused["concurrent"],
    "generations": stats["generations"],
    "max_admitted_in_a_second": stats["max_admitted_in_a_second"],
    "max_in_progress": stats["max_in_progress"],
    "wall_s": round(wall, 1),
    # What the mock admitted in each second of the run (its own tally), for the P7 plot.
    "admitted_per_second": [
        second["requests"]
        for second in stats["admissions_per_second"]
        if second["requests"] > 0
    ],
}
if variant == "tpm":
    tokens = sum(second["tokens"] for second in stats["admissions_per_second"])
    line["limit_tpm"] = tpm
    line["tokens_per_s"] = round(tokens / wall)
    line["ratio_to_token_limit"] = round(tokens / wall / (tpm / 60), 3)
    line["max_tokens_in_a_second"] = stats["max_tokens_in_a_second"]
with open("target/bench/capacity.jsonl", "a") as out:
    out.write(json.dumps(line) + "\n")
print(
    "bench-capacity: variant={variant} settings={settings} tasks={tasks} completed={completed} "
    "failed={failed} unfinished={unfinished} replies_per_s={replies_per_s} "
    "ratio_to_limit={ratio_to_limit} (limit {limit}/s) requests={requests} refused={refused} "
    "refused_share={refused_share} (rpm {refused_rpm}, tpm {refused_tpm}, concurrent "
    "{refused_concurrent}) generations={generations} max_admitted_in_a_second="
    "{max_admitted_in_a_second} max_in_progress={max_in_progress} wall_s={wall_s}".format(
        limit=f"{limit_per_s:g}", **line
    )
    + (
        f" tokens_per_s={line['tokens_per_s']} ratio_to_token_limit="
        f"{line['ratio_to_token_limit']} (limit {tpm // 60}/s) max_tokens_in_a_second="
        f"{line['max_tokens_in_a_second']}"
        if variant == "tpm"
        else ""
    )
)
PY
if [ -n "$reasons" ]; then
  echo "bench-capacity: most frequent failures (count, reason):" >&2
  echo "$reasons" | sed 's/^/  /' >&2
fi
[ "$(( tasks - completed - failed ))" -eq 0 ]
