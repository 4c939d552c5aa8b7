# Sourced by scripts/test.sh and scripts/bench.sh: creates the virtual environment $VENV
# (default .venv) if needed, installs the pinned requirements (CPU torch) and builds cpshard into
# it as an editable install. Run from the repository root.
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -r requirements-dev.txt
"$VENV/bin/pip" install -q --no-build-isolation -e .
