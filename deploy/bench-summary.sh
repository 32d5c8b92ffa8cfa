#!/usr/bin/env bash
# Writes target/bench/summary.json from the benchmark runs' JSON lines and draws the plots in
# docs/bench/. matplotlib comes from PyPI into a virtual environment cached outside the work
# tree (installed once per machine); without it the summary is still written.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
version=3.11.2
venv="${REPLYD_CACHE_DIR:-$HOME/.cache/replyd}/venv-bench-plots-$version"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
  echo "bench-summary: installing matplotlib $version into $venv" >&2
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q "matplotlib==$version"; } >&2; then
    echo "bench-summary: no matplotlib; summary only" >&2
    exec python3 deploy/bench_summary.py
  fi
fi
exec "$venv/bin/python" deploy/bench_summary.py
