#!/usr/bin/env bash
# The API's memory against the end users it has seen: USERS distinct end users' tokens, one
# request each (deploy/bench_users.py), against one `replyd api`, its resident set sampled as
# they go and once more after the next sweep of the rate limit's buckets (one bucket per end
# user, swept every 30 s). The resident set should level off, not grow with the users.
#
# Usage: deploy/bench-users.sh [users] [threads]   (default: 100000 8)
# Writes one JSON line per sample to stdout and to target/bench/users.jsonl.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
users=${1:-100000}
threads=${2:-8}
infra_parts=postgres

# shellcheck source=deploy/lib.sh
. deploy/lib.sh
prepare
dir="$root/target/bench/users-$(date +%Y%m%d%H%M%S)"
mkdir -p "$dir"
id="users-$$"
db_url=$(schema_url "bench_$id")
schema=$(echo "bench_$id" | tr -c 'a-zA-Z0-9\n' '_')
topic="bench-$id"
write_settings "$dir/$id.toml" 'kafka.bootstrap_servers=' 'kafka.topic=' 'kafka.group_id=' \
  'provider.base_url='
"$bin" migrate --config "$dir/$id.toml" 2>"$dir/migrate.log"
"$bin" workspace create acme --config "$dir/$id.toml" >/dev/null
key=$("$bin" api-key create --workspace acme --config "$dir/$id.toml" 2>/dev/null)
RUST_LOG=info,replyd::api::rate_limit=debug "$bin" api --config "$dir/$id.toml" 2>"$dir/api.log" &
api_pid=$!
pids+=("$api_pid")
api="http://$(api_addr "$dir/api.log")"
# The first token asked for makes the workspace's signing secret.
curl -fsS -o /dev/null -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
  -d '{"user_id":"first"}' "$api/v1/end-user-tokens"
secret=$(psql -qtA "$db_url" -c "select secret from end_user_token_secrets where workspace_id = 'acme'")
python3 deploy/bench_users.py "$api" acme "$secret" "$api_pid" "$users" "$threads" \
  | tee -a "$root/target/bench/users.jsonl"
grep 'rate-limit buckets swept' "$dir/api.log" | tail -n 3 >&2 || true
psql -q "$DATABASE_URL" -c "drop schema $schema cascade" >/dev/null 2>&1 || true
