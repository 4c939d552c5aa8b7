#!/usr/bin/env bash
# Sanitizer job: build cpshard._C with AddressSanitizer + UBSan (CPSHARD_SANITIZE=1, CPU only) in a
# scratch copy of the repository and run the hypothesis fuzz tests (and tests/ops/test_ops.py when
# it exists, and the NCCL communicator's bounded waits and life driven by stand-ins) against that
# build, then the communicator-life thread cases ten times in a row on one core.
# Exits non-zero when the build or a test fails, when the loaded
# extension is not the sanitized one, or when a sanitizer reports anything.
#
# Environment:
#   PYTHON                 interpreter with torch, pytest and hypothesis (default: python)
#   CPSHARD_FUZZ_EXAMPLES  hypothesis examples per fuzz property (default 400)
#   SANITIZE_SOURCE        worktree (default): tracked + untracked-but-not-ignored files as they
#                          are on disk (so uncommitted work is fuzzed too; build/, *.so, venvs
#                          and other ignored paths are left out); head: `git archive HEAD`
#   SANITIZE_KEEP          1 keeps the scratch directory (its path is printed)
#   MAX_JOBS               parallel compile jobs (default: all cores)
# Extra arguments go to pytest, e.g. `.ci/sanitize.sh -k pack`.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
# A relative interpreter path (e.g. .ci-work/venv-cpu/bin/python) is relative to the repo.
if [[ "$PYTHON" == */* && "$PYTHON" != /* ]]; then PYTHON="$repo/$PYTHON"; fi
command -v "$PYTHON" >/dev/null || { echo "sanitize: no interpreter $PYTHON" >&2; exit 2; }
export CPSHARD_FUZZ_EXAMPLES=${CPSHARD_FUZZ_EXAMPLES:-400}

t0=$(date +%s)
stamp() { echo "== sanitize [$(( $(date +%s) - t0 ))s] $*"; }

work=$(mktemp -d "${TMPDIR:-/tmp}/cpshard-sanitize.XXXXXX")
cleanup() {
  if [[ "${SANITIZE_KEEP:-0}" == 1 ]]; then echo "sanitize: kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

stamp "copying the ${SANITIZE_SOURCE:-worktree} into $work"
case "${SANITIZE_SOURCE:-worktree}" in
  head) git -C "$repo" archive --format=tar HEAD | tar -x -C "$work" ;;
  worktree)
    # Tracked files still on disk plus untracked files git does not ignore.
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done \
      | tar --null -T - -cf -) | tar -x -C "$work" ;;
  *) echo "sanitize: SANITIZE_SOURCE must be worktree or head" >&2; exit 2 ;;
esac
rm -rf "$work/build" && find "$work" -name '*.so' -delete

stamp "building with CPSHARD_SANITIZE=1 ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
build_start=$(date +%s)
(cd "$work" && CPSHARD_SANITIZE=1 CPSHARD_CUDA=0 "$PYTHON" setup.py -q build_ext --inplace) \
  > "$work/build.log" 2>&1 || { tail -n 60 "$work/build.log"; echo "sanitize: build failed" >&2; exit 1; }
build_s=$(( $(date +%s) - build_start ))
stamp "build took ${build_s}s"

asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
for lib in "$asan" "$ubsan"; do
  [[ -e "$lib" ]] || { echo "sanitize: $lib not found (gcc's sanitizer runtimes)" >&2; exit 2; }
done
# The extension is loaded by an uninstrumented python, so the ASan runtime has to come first in
# the process (LD_PRELOAD). Leak detection is off: CPython and torch keep memory to exit by design.
# allocator_may_return_null: an impossible allocation (a fuzzed size near 2**62) fails like it does
# without ASan (torch raises) instead of aborting the run; ASan still prints a one-line
# "failed to allocate" warning for it, which the report check below ignores.
export LD_PRELOAD="$asan $ubsan${LD_PRELOAD:+ $LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONFAULTHANDLER=1
export CPSHARD_FUZZ_REPORT="$work/fuzz-examples.json"

stamp "checking that the sanitized extension is the one that loads"
(cd "$work" && "$PYTHON" -c '
import cpshard, sys
info = cpshard.build_info()
print("   ", cpshard._C.__file__, info)
sys.exit(0 if info.sanitized else "cpshard.build_info().sanitized is False")
')

tests=(tests/ops/test_ops_fuzz.py)
[[ -f "$work/tests/ops/test_ops.py" ]] && tests+=(tests/ops/test_ops.py)
# The NCCL communicator's bounded waits and its life (watchdog, calls, close: threads of their
# own) driven by stand-ins.
for t in tests/comm/test_nccl_settle.py tests/comm/test_nccl_within.py \
  tests/comm/test_nccl_life.py; do
  [[ -f "$work/$t" ]] && tests+=("$t")
done
stamp "pytest ${tests[*]} (CPSHARD_FUZZ_EXAMPLES=$CPSHARD_FUZZ_EXAMPLES)"
test_start=$(date +%s)
status=0
# --capture=sys: pytest captures Python's sys.stdout/stderr only, so a sanitizer report (written
# by C code to fd 2 right before the process aborts) reaches the log instead of a capture file.
(cd "$work" && "$PYTHON" -m pytest -p no:cacheprovider --capture=sys -q -rfEX "${tests[@]}" "$@") \
  2>&1 | tee "$work/pytest.log" || status=$?

# The communicator-life cases whose threads race each other (watchdog, calls, abort, close), ten
# runs in a row pinned to one core, where a window between two threads is widest: a race that
# one run on two cores passes by luck fails here. (The interpreter-exit and teardown cases run
# subprocesses, once above.)
if command -v taskset >/dev/null && [[ -f "$work/tests/comm/test_nccl_life.py" ]]; then
  for run in $(seq 10); do
    stamp "tests/comm/test_nccl_life.py thread cases, run $run of 10 on one core (taskset -c 0)"
    (cd "$work" && taskset -c 0 "$PYTHON" -m pytest -p no:cacheprovider --capture=sys -q -rfEX \
      tests/comm/test_nccl_life.py -k "not interpreter_exit and not teardown") \
      2>&1 | tee -a "$work/pytest.log" | tail -n 3 || status=$?
  done
fi
test_s=$(( $(date +%s) - test_start ))

if grep -E -q 'runtime error:|ERROR: AddressSanitizer|ERROR: LeakSanitizer|SUMMARY: (Address|Undefined)BehaviorSanitizer|SUMMARY: AddressSanitizer' "$work/pytest.log"; then
  echo "sanitize: a sanitizer reported an error (see above)" >&2
  status=1
fi
examples=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["total"])' "$CPSHARD_FUZZ_REPORT" 2>/dev/null || echo "?")
stamp "build ${build_s}s, tests ${test_s}s, ${examples} fuzz examples under ASan+UBSan; exit status $status"
exit "$status"
