#!/usr/bin/env bash
# CUDA compile-only job: a virtual environment with a CUDA 13 torch (CPSHARD_TORCH, default the
# oldest supported, 2.11.0), a wheel of
# cpshard built with CPSHARD_CUDA=1 for TORCH_CUDA_ARCH_LIST (default 9.0) from a scratch copy of
# the working tree (so the CPU build in build/ and cpshard/_C*.so of the repository are never
# touched), the wheel installed non-editable, and checks run from outside the repository: the
# extension imports, reports CUDA kernels, every cpshard op has a CUDA kernel registered, and the
# NCCL transport makes a unique id through its own bootstrap function (cpshard.comm.nccl).
# Then the CPU test suite runs against that build (CUDA torch, CPU tensors). Nothing CUDA runs:
# this machine has no GPU. Exits non-zero on any failure.
#
# Usage: .ci/cuda_compile.sh [VENV] [pytest args...]
#   VENV                    virtual environment to (re)create (default .ci-work/venv-cuda; a
#                           relative path is relative to the repository root)
#   pytest args             test paths / options for step 4 (default: all of tests/)
# Environment:
#   PYTHON                  interpreter that creates the venv (default python3)
#   CPSHARD_TORCH           the torch release to build against (default 2.11.0; installed with
#                           pip's local cap on torch lifted for this command)
#   CPSHARD_REUSE_VENV      1 keeps VENV when it already has that torch (default: recreate it)
#   CPSHARD_CUDA_TESTS      0 skips the CPU test suite against the CUDA build (default 1)
#   CPSHARD_CPU_BUILD_CHECK 1 also builds the CPU-only extension against this CUDA torch with no
#                           CUDA toolkit on the path, and loads it (default 0)
#   CUDA_HOME               CUDA toolkit (default /usr/local/cuda)
#   TORCH_CUDA_ARCH_LIST    architectures to compile for (default 9.0; set and empty: the
#                           wheel's default list, 8.0;9.0;10.0+PTX)
#   CUDA_COMPILE_KEEP       1 keeps the scratch directory (its path is printed)
#   MAX_JOBS                parallel compile jobs (default: all cores)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-.ci-work/venv-cuda}
[[ $# -gt 0 ]] && shift
[[ "$venv" == /* ]] || venv="$repo/$venv"
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${CPSHARD_TORCH:-2.11.0}
TORCH_PIN="torch==$TORCH_VERSION"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-9.0}  # set but empty: the wheel's default list
[[ -n "$TORCH_CUDA_ARCH_LIST" ]] || unset TORCH_CUDA_ARCH_LIST
export PIP_DISABLE_PIP_VERSION_CHECK=1

t0=$(date +%s)
stamp() { echo "== cuda_compile [$(( $(date +%s) - t0 ))s] $*"; }
fail() { echo "cuda_compile: $*" >&2; exit 1; }

[[ -x "$CUDA_HOME/bin/nvcc" ]] || fail "no nvcc under CUDA_HOME=$CUDA_HOME"

work=$(mktemp -d "${TMPDIR:-/tmp}/cpshard-cuda.XXXXXX")
cleanup() {
  if [[ "${CUDA_COMPILE_KEEP:-0}" == 1 ]]; then echo "cuda_compile: kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

# ---- 1. the environment ------------------------------------------------------------------------
step=$(date +%s)
if [[ "${CPSHARD_REUSE_VENV:-0}" == 1 && -x "$venv/bin/python" ]] &&
   "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != sys.argv[1])' "$TORCH_VERSION" 2>/dev/null; then
  stamp "reusing $venv"
else
  stamp "creating $venv ($TORCH_PIN, CUDA 13; ~5.5 GB)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
fi
PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q "$TORCH_PIN" "setuptools>=70.1" wheel "cmake>=3.26" ninja pytest hypothesis expecttest numpy \
  > "$work/pip.log" 2>&1 \
  || { grep -v "^WARNING: Location 'file://" "$work/pip.log" | tail -n 40; fail "pip install failed"; }
"$venv/bin/python" -c 'import sys, torch
print("   torch", torch.__version__, "CUDA", torch.version.cuda)
sys.exit(0 if torch.version.cuda else "this torch has no CUDA")'
venv_s=$(( $(date +%s) - step ))
stamp "environment ready in ${venv_s}s"

# ---- 2. the wheel, built from a scratch copy of the working tree -------------------------------
src="$work/src"
mkdir -p "$src"
# Tracked files still on disk plus untracked files git does not ignore (uncommitted work included;
# build/, *.so, venvs and other ignored paths are left out).
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf -) | tar -x -C "$src"
rm -rf "$src/build" && find "$src" -name '*.so' -delete

stamp "building the wheel (CPSHARD_CUDA=1, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-<default>}, $("$CUDA_HOME/bin/nvcc" --version | tail -n 2 | head -n 1))"
step=$(date +%s)
log="$work/build.log"
(cd "$src" && PATH="$venv/bin:$PATH" CPSHARD_CUDA=1 \
  "$venv/bin/pip" wheel --no-build-isolation --no-deps -v -w "$work/dist" .) > "$log" 2>&1 \
  || { tail -n 80 "$log"; fail "the CUDA build failed (log above)"; }
build_s=$(( $(date +%s) - step ))
stamp "CUDA build took ${build_s}s"
# Compiler warnings (nvcc, the host compiler, the linker) in the build log, for the record.
warnings=$(grep -E "warning( #[0-9A-Za-z-]+)?[:-]" "$log" | grep -v "byte-compiling is disabled" | sort -u || true)
if [[ -n "$warnings" ]]; then
  echo "   compiler warnings ($(echo "$warnings" | wc -l)):"
  echo "$warnings" | sed 's/^/     /' | head -n 40
else
  echo "   no compiler warnings"
fi

# The architectures torch's CMake compiled for (it logs its -gencode flags).
gencode=$(grep -o "Added CUDA NVCC flags for: .*" "$log" | head -n 1 || true)
echo "   ${gencode:-no gencode flags logged}"
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  for want in code=sm_80 code=sm_90 code=sm_100 code=compute_100; do
    [[ "$gencode" == *"$want"* ]] || fail "the default architecture list lacks $want"
  done
fi
wheel=$(ls "$work"/dist/cpshard-*.whl)
"$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel"
stamp "installed $(basename "$wheel")"

# ---- 3. checks, from outside the repository ----------------------------------------------------
cd "$work"
"$venv/bin/python" - <<'EOF'
import pathlib
import sys

import torch

import cpshard
import cpshard._C as C

so = pathlib.Path(C.__file__).resolve()
print("   loaded", so)
assert "site-packages" in so.parts, f"imported {so}, not the installed wheel"
assert C.cuda_kernels, "cpshard._C.cuda_kernels is False: the CUDA kernels were not built"
ops = ["pack_ragged", "unpack_ragged", "interleave_sequence", "deinterleave_sequence",
       "index_gather", "index_scatter_add", "document_segments"]
missing = []
for op in ops:
    for key in ("CPU", "CUDA"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"cpshard::{op}", key):
            missing.append(f"{op}/{key}")
assert not missing, f"no kernel registered for: {', '.join(missing)}"
print("   cuda_kernels = True; CPU and CUDA kernels registered for", len(ops), "ops")
# The CPU path of the CUDA build still works (a CUDA launch would need a GPU this machine lacks).
x = torch.arange(10.0).reshape(5, 2)
packed = torch.ops.cpshard.pack_ragged(x, [2, 3], 0, 3, -1.0)
assert packed.shape == (2, 3, 2) and packed[0, 2].eq(-1).all()
assert torch.equal(torch.ops.cpshard.unpack_ragged(packed, [2, 3], 0, 3, [5, 2]), x)
print("   CPU round trip through the CUDA build: ok")
assert C.nccl, "cpshard._C.nccl is False: the NCCL communicator was not built"
# The NCCL transport's own code path, as far as it goes without a GPU: the module imports, the
# TorchBind class is found under torch.classes, the bootstrap's unique id is made by the very
# function the unique-id bootstrap calls, and the NCCL we run against is the one torch uses.
from cpshard.comm import nccl

uid = nccl.unique_id()
assert uid.dtype == torch.uint8 and uid.shape == (nccl.UNIQUE_ID_BYTES,), uid
assert uid.any(), "an all-zero ncclUniqueId"
# Every NCCL library loaded in the process (torch's and ours) reports, at run time, the version
# ours runs: the split's precondition.
from cpshard.comm import nccl_runtime

loaded = nccl_runtime.loaded_versions()
assert loaded and nccl_runtime.mismatch(int(nccl._native().version()), loaded) == "", loaded
assert nccl.bootstrap_mode() == "split"
print("   NCCL communicator built; NCCL", ".".join(map(str, nccl.version())), "(torch's);",
      "unique id of", uid.numel(), "bytes made through cpshard.comm.nccl.unique_id")
# A communicator on a device this machine does not have is refused, naming the device, before
# anything reaches NCCL.
try:
    torch.classes.cpshard.NcclCommunicator(0, 0, uid, 0, 1, 0, 60.0)
except RuntimeError as e:
    assert "device 0 is not a visible CUDA device" in str(e), e
else:
    raise AssertionError("a communicator was created without a GPU")
print("   NcclCommunicator refuses a device that is not visible")
EOF
stamp "import checks passed"
# The lent GPU machine's check, as far as it goes without a device: its scripts parse, the
# steady-state script imports and skips, the numeric checks run on the CPU loop path.
bash -n "$src/scripts/gpu/check.sh" || fail "scripts/gpu/check.sh does not parse"
"$venv/bin/python" "$src/scripts/gpu/steady_state.py" | tee "$work/steady.txt"
grep -q "^skipped: " "$work/steady.txt" || fail "steady_state.py did not skip without a GPU"
"$venv/bin/python" -m cpshard.bench.nccl_world1 | tee "$work/world1.txt"
grep -q "^skipped: " "$work/world1.txt" \
  || fail "cpshard.bench.nccl_world1 did not skip without a GPU"
OMP_NUM_THREADS=1 "$venv/bin/python" "$src/scripts/gpu/numerics.py" --device cpu \
  || fail "scripts/gpu/numerics.py --device cpu failed"
stamp "GPU check scripts: parse, skip, CPU numerics passed"

# ---- 3b. the CPU-only build against this CUDA torch, no CUDA toolkit in sight -------------------
# What pip does for a user whose torch is PyPI's default CUDA build on a machine without nvcc:
# the CPU extension must build and load (torch's CMake package would demand the toolkit).
if [[ "${CPSHARD_CPU_BUILD_CHECK:-0}" == 1 ]]; then
  step=$(date +%s)
  cpu_src="$work/cpu-src"
  cp -r "$src" "$cpu_src" && rm -rf "$cpu_src/build"
  (cd "$cpu_src" && env -u CUDA_HOME -u CUDA_PATH PATH="$venv/bin:/usr/bin:/bin" CPSHARD_CUDA=0 \
    "$venv/bin/python" setup.py build_ext --inplace) > "$work/cpu-build.log" 2>&1 \
    || { tail -n 40 "$work/cpu-build.log"; fail "the CPU-only build against a CUDA torch failed"; }
  (cd "$cpu_src" && "$venv/bin/python" -c '
import pathlib, sys, torch, cpshard
info = cpshard.build_info()
assert pathlib.Path(cpshard.__file__).parent == pathlib.Path.cwd() / "cpshard", cpshard.__file__
assert torch.version.cuda and not info.cuda_kernels and not info.nccl, info
x = torch.arange(10.0).reshape(5, 2)
assert torch.ops.cpshard.pack_ragged(x, [2, 3], 0, 3, -1.0).shape == (2, 3, 2)
print("   CPU-only build against torch", torch.__version__, "loads and runs:", info)') \
    || fail "the CPU-only build against a CUDA torch does not load"
  stamp "CPU-only build against the CUDA torch without a toolkit: ok in $(( $(date +%s) - step ))s"
fi

# ---- 4. the CPU test suite against the CUDA build ----------------------------------------------
if [[ "${CPSHARD_CUDA_TESTS:-1}" == 1 && -d "$repo/tests" ]]; then
  mkdir -p "$work/run"
  cp -r "$src/tests" "$work/run/tests"
  cp -r "$src/examples" "$work/run/examples"  # the tests' shared references read their runs
  [[ -f "$src/pyproject.toml" ]] && cp "$src/pyproject.toml" "$work/run/"
  stamp "pytest (CPU tensors, CUDA build) from $work/run"
  step=$(date +%s)
  (cd "$work/run" && "$venv/bin/python" -m pytest -p no:cacheprovider -q -rfE "${@:-tests}")
  stamp "tests took $(( $(date +%s) - step ))s"
fi

stamp "done (environment ${venv_s}s, CUDA build ${build_s}s)"
