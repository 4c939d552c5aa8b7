#!/usr/bin/env bash
# Sets up the virtual environment like scripts/test.sh, builds cpshard and runs `cpshard bench`
# (default: 4 local gloo ranks on CPU). Usage: scripts/bench.sh [cpshard bench args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec "$VENV/bin/cpshard" bench "$@"
