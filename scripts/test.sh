#!/usr/bin/env bash
# Sets up a virtual environment (pinned CPU torch), builds cpshard in it and runs the test suite.
# Usage: scripts/test.sh [pytest args...]   (VENV=path to choose the environment, default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec "$VENV/bin/python" -m pytest "$@"
