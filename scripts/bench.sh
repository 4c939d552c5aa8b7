#!/usr/bin/env bash
# Sets up the virtual environment like scripts/test.sh, builds cpshard and runs `cpshard bench`
# (default: 4 local gloo ranks on CPU). Usage: scripts/bench.sh [cpshard bench args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -r requirements-dev.txt
"$VENV/bin/pip" install -q --no-build-isolation -e .
exec "$VENV/bin/cpshard" bench "$@"
