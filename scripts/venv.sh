# Sourced by scripts/test.sh and scripts/bench.sh: creates the virtual environment $VENV
# (default .venv) if needed, installs the pinned requirements (CPU torch) and builds cpshard into
# it as an editable install. Run from the repository root.
#
# The install and build are skipped when nothing they depend on changed: a stamp in the
# environment holds a hash of the requirements, csrc/, CMakeLists.txt, setup.py, pyproject.toml,
# the CPSHARD_* build switches and this checkout's path; it is written after a successful build
# and the skip also needs the editable install's extension (cpshard/_C*.so) in this tree, so a
# fresh checkout, another checkout sharing $VENV and a csrc/ change all rebuild.
# CPSHARD_REBUILD=1 forces the install and build.
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
_cpshard_stamp="$VENV/.cpshard-build-stamp"
_cpshard_hash=$(
  {
    pwd -P
    env | grep '^CPSHARD_' | grep -v '^CPSHARD_REBUILD=' | sort
    find requirements-dev.txt CMakeLists.txt setup.py pyproject.toml csrc -type f -print0 \
      | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -d' ' -f1
)
if [ "${CPSHARD_REBUILD:-0}" != 1 ] && [ -f "$_cpshard_stamp" ] \
  && [ "$(cat "$_cpshard_stamp")" = "$_cpshard_hash" ] && compgen -G "cpshard/_C*.so" >/dev/null; then
  : # up to date: nothing to install or build
else
  rm -f "$_cpshard_stamp"
  "$VENV/bin/pip" install -q -r requirements-dev.txt
  "$VENV/bin/pip" install -q --no-build-isolation -e .
  echo "$_cpshard_hash" >"$_cpshard_stamp"
fi
unset _cpshard_stamp _cpshard_hash
