# Shared by demo.sh and the bench scripts (sourced, not run): local infrastructure, a release
# build, processes stopped by their pids on exit, the mock provider, a schema per run.

# Starts the infrastructure (the parts in $infra_parts, PostgreSQL and Kafka by default),
# exports DATABASE_URL and KAFKA_BOOTSTRAP (and SQS_ENDPOINT), builds replyd and replyd-lab
# (release) and sets $bin (the service) and $lab (the mock provider, the simulated browsers,
# the producer). Installs psql when missing (the scripts read progress with it).
# REPLYD_INFRA_ENV names the env file of infrastructure already running (another checkout's
# target/infra/env): its addresses are used as they are and nothing is started or checked.
prepare() {
  local env_file=target/infra/env
  if [ -n "${REPLYD_INFRA_ENV:-}" ]; then
    env_file=$REPLYD_INFRA_ENV
  else
    # shellcheck disable=SC2086 # a list of parts
    bash deploy/infra.sh up ${infra_parts:-postgres kafka} >/dev/null
  fi
  if ! command -v psql >/dev/null; then
    echo "installing postgresql-client (psql)" >&2
    local sudo_=""
    [ "$(id -u)" -eq 0 ] || sudo_=sudo
    $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-client >/dev/null
  fi
  set -a
  # shellcheck disable=SC1090 # the infrastructure's own file
  . "$env_file"
  set +a
  # Progress shown: a first build compiles librdkafka and about 300 crates (about 9 minutes
  # on 2 cores); later builds take seconds.
  # REPLYD_BIN names a binary already built (a debug build, another checkout's) instead, and
  # REPLYD_LAB_BIN its tools (by default the replyd-lab beside it).
  if [ -n "${REPLYD_BIN:-}" ]; then
    bin=$REPLYD_BIN
    lab=${REPLYD_LAB_BIN:-$(dirname "$bin")/replyd-lab}
    [ -x "$lab" ] || { echo "no replyd-lab at $lab (set REPLYD_LAB_BIN)" >&2; exit 1; }
    return
  fi
  local out="${CARGO_TARGET_DIR:-$PWD/target}/release"
  if [ ! -x "$out/replyd" ]; then
    echo "building replyd (release); the first build takes about 9 minutes on 2 cores" >&2
  fi
  cargo build --release -p replyd -p replyd-lab
  bin="$out/replyd"
  lab="$out/replyd-lab"
}

# Processes this script started; all get SIGTERM (their drain path) and are waited for on exit.
pids=()
stop_started() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_started EXIT

# start_mock LOG_PREFIX [mock-provider flags...]: starts the mock on a free port, records its
# pid in $mock_pid and its base URL in $mock_url. Like the real chat APIs the mock honours no
# Idempotency-Key unless given `--honour-idempotency-key true`; a script whose figures depend
# on it says so.
start_mock() {
  local prefix=$1
  shift
  "$lab" mock-provider --listen 127.0.0.1:0 "$@" >"$prefix.out" 2>"$prefix.log" &
  mock_pid=$!
  pids+=("$mock_pid")
  mock_url=""
  for _ in $(seq 1 100); do
    mock_url=$(sed -n 's/^mock-provider listening on //p' "$prefix.out")
    [ -n "$mock_url" ] && return 0
    sleep 0.1
  done
  cat "$prefix.log" >&2
  echo "the mock provider did not start" >&2
  exit 1
}

# write_settings FILE [section.key=VALUE ...]: writes a settings file with what every script's
# processes share (the database at $db_url, the brokers, topic and group "$topic", the mock at
# $mock_url, every listener on a free port), each given pair added or put in place of the
# shared one. VALUE is TOML as written (a string quoted: 'worker.worker_id="w1"'), so a script
# says only what differs; an empty VALUE ('kafka.session_timeout_ms=') leaves the key out, to the binary's
# default (a section left empty is not written).
write_settings() {
  local file=$1
  shift
  {
    printf '%s\n' \
      "database.url=\"$db_url\"" \
      "kafka.bootstrap_servers=\"${KAFKA_BOOTSTRAP:-}\"" \
      "kafka.topic=\"$topic\"" \
      "kafka.group_id=\"$topic\"" \
      "provider.base_url=${mock_url:+\"$mock_url\"}" \
      'api.listen="127.0.0.1:0"' \
      'observability.listen="127.0.0.1:0"'
    printf '%s\n' "$@"
  } | awk '
    {
      eq = index($0, "="); path = substr($0, 1, eq - 1); value = substr($0, eq + 1)
      dot = index(path, "."); section = substr(path, 1, dot - 1); key = substr(path, dot + 1)
      if (!(section in seen)) { seen[section] = 1; order[++sections] = section }
      id = section SUBSEP key
      if (!(id in values)) { keys[section] = keys[section] SUBSEP key }
      values[id] = value
    }
    END {
      for (i = 1; i <= sections; i++) {
        section = order[i]
        lines = ""
        n = split(substr(keys[section], 2), list, SUBSEP)
        for (j = 1; j <= n; j++) {
          value = values[section SUBSEP list[j]]
          if (value != "") lines = lines list[j] " = " value "\n"
        }
        if (lines != "") printf "[%s]\n%s", section, lines
      }
    }' >"$file"
}

# start_front_half SETTINGS WORKSPACE LOG_DIR: migrates the schema, makes WORKSPACE and its API
# key ($key), creates the topic with $partitions partitions (1 when unset; not on an SQS
# $source, whose queue the caller makes), and starts
# `replyd api` (its address in $api) and `replyd relay` with SETTINGS, their logs in LOG_DIR.
# Run `quota set` or anything else the workspace needs through $bin afterwards.
start_front_half() {
  local settings=$1 workspace=$2 logs=$3
  "$bin" migrate --config "$settings" 2>"$logs/migrate.log"
  "$bin" workspace create "$workspace" --config "$settings" >/dev/null
  key=$("$bin" api-key create --workspace "$workspace" --config "$settings" 2>/dev/null)
  if [ "${source:-kafka}" = kafka ]; then
    "$lab" produce --config "$settings" --create-partitions "${partitions:-1}" --count 0 >/dev/null
  fi
  "$bin" api --config "$settings" 2>"$logs/api.log" &
  pids+=($!)
  "$bin" relay --config "$settings" 2>"$logs/relay.log" &
  pids+=($!)
  api=$(api_addr "$logs/api.log")
}

# schema_url NAME: creates schema NAME and prints a database URL whose sessions use it.
schema_url() {
  local schema
  schema=$(echo "$1" | tr -c 'a-zA-Z0-9\n' '_')
  psql -q "$DATABASE_URL" -c "create schema $schema" >/dev/null
  local sep='?'
  case "$DATABASE_URL" in *\?*) sep='&' ;; esac
  echo "${DATABASE_URL}${sep}options=-c%20search_path%3D${schema}"
}

# wait_until_assigned TIMEOUT_S LOG...: waits until every worker whose log is given holds at
# least one partition (its /metrics, at the address its start-up line names).
wait_until_assigned() {
  local limit=$1
  shift
  local deadline=$(( $(date +%s) + limit )) log addr n
  for log in "$@"; do
    # The log may not exist yet: the worker has just been started.
    until addr=$(sed -n 's/.*addr=\([0-9.:]*\).*/\1/p' "$log" 2>/dev/null | tail -n 1) && [ -n "$addr" ] \
      && n=$(metric "$addr" replyd_assigned_partitions) && [ "${n%.*}" -ge 1 ] 2>/dev/null; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "no partitions for the worker of $log within ${limit}s" >&2; return 1; }
      sleep 0.5
    done
  done
}

# metric ADDR NAME: the value of an unlabelled metric on ADDR's /metrics page.
metric() {
  local page
  page=$(exec 3<>"/dev/tcp/${1%:*}/${1##*:}" && printf 'GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n' >&3 && cat <&3) || return 1
  echo "$page" | tr -d '\r' | sed -n "s/^$2 //p" | head -n 1 | grep . || return 1
}

# terminal_count URL: tasks completed or failed.
terminal_count() {
  psql -qtA "$1" -c "select count(*) from reply_tasks where status in ('completed','failed')" 2>/dev/null || echo 0
}

# api_addr LOG: waits (10 s at most) for `replyd api`'s start-up line in LOG and prints the
# address it serves on; exits the script when it does not come.
api_addr() {
  local addr=""
  for _ in $(seq 1 100); do
    addr=$(sed -n 's/.*API listening addr=\([0-9.:]*\).*/\1/p' "$1" | head -n 1)
    [ -n "$addr" ] && { echo "$addr"; return 0; }
    sleep 0.1
  done
  echo "the API did not start; see $1" >&2
  exit 1
}

# stats: the median and the spread of the numbers on stdin, as "median min max".
stats() {
  sort -g | awk '{ v[NR] = $1 } END {
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%s %s %s\n", m, v[1], v[NR]
  }'
}

# start_two_workers DIR ID: two workers (w1, w2) with DIR/worker.toml on schema bench_ID and a
# 6-partition topic bench-ID against the mock at $mock_url, their logs in DIR; returns once
# both hold partitions. Sets db_url (the run's schema) and workers (their pids, also in pids).
start_two_workers() {
  local dir=$1 id=$2
  db_url=$(schema_url "bench_$id")
  export REPLYD_DATABASE__URL="$db_url"
  export REPLYD_KAFKA__BOOTSTRAP_SERVERS="$KAFKA_BOOTSTRAP"
  export REPLYD_KAFKA__TOPIC="bench-$id"
  export REPLYD_KAFKA__GROUP_ID="bench-$id"
  export REPLYD_PROVIDER__BASE_URL="$mock_url"
  # Two workers on one machine: each its own metrics port (printed in its log).
  export REPLYD_OBSERVABILITY__LISTEN="127.0.0.1:0"
  "$bin" config check --config "$dir/worker.toml" >/dev/null
  "$lab" produce --config "$dir/worker.toml" --create-partitions 6 --count 0 >/dev/null
  workers=()
  local w
  for w in w1 w2; do
    REPLYD_WORKER__WORKER_ID=$w "$bin" worker --config "$dir/worker.toml" 2>"$dir/$w.log" &
    workers+=($!)
    pids+=($!)
  done
  wait_until_assigned 60 "$dir/w1.log" "$dir/w2.log"
}
