#!/usr/bin/env bash
# Sets up a virtual environment (pinned CPU torch), builds cpshard in it and runs the test suite.
# Usage: scripts/test.sh [pytest args...]   (VENV=path to choose the environment, default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -r requirements-dev.txt
"$VENV/bin/pip" install -q --no-build-isolation -e .
exec "$VENV/bin/python" -m pytest "$@"
