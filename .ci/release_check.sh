#!/usr/bin/env bash
# Release check: the source archive and the wheel install and work in a fresh environment.
#   1. the sdist, built from a scratch copy of the working tree with setuptools' own PEP 517
#      hook (no network, no extra tool), carries csrc/, CMakeLists.txt and setup.py, and no
#      built file;
#   2. a fresh virtual environment with the pinned CPU torch installs that sdist (the extension
#      compiles from the archive alone) and passes the smoke test, run from outside the tree;
#   3. `pip wheel --no-build-isolation` builds a wheel from the sdist; the same environment
#      replaces the sdist install with it, and the smoke test passes again.
# Usage: .ci/release_check.sh [WORK]   (WORK: scratch folder, default .ci-work/release)
# Environment: PYTHON (interpreter for the venv, default python3), TORCH_PIN (default
#   torch==2.13.0+cpu), MAX_JOBS.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$repo/.ci-work/release}
[[ "$work" == /* ]] || work="$repo/$work"
PYTHON=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0+cpu}
export PIP_DISABLE_PIP_VERSION_CHECK=1 CPSHARD_CUDA=0
t0=$(date +%s)
stamp() { echo "== release [$(( $(date +%s) - t0 ))s] $*"; }
fail() { echo "release_check: $*" >&2; exit 1; }

rm -rf "$work" && mkdir -p "$work/src" "$work/dist" "$work/run"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf -) | tar -x -C "$work/src"

stamp "fresh venv with $TORCH_PIN"
"$PYTHON" -m venv "$work/venv"
py="$work/venv/bin/python"
"$work/venv/bin/pip" install -q "$TORCH_PIN" "setuptools>=70.1" wheel numpy ninja "cmake>=3.25" > "$work/pip.log" 2>&1 \
  || { tail -n 30 "$work/pip.log"; fail "pip install of $TORCH_PIN failed"; }

stamp "sdist (setuptools' build_sdist)"
(cd "$work/src" && "$py" -c 'import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))' "$work/dist") > "$work/sdist.log" 2>&1 \
  || { tail -n 30 "$work/sdist.log"; fail "building the sdist failed"; }
sdist=$(ls "$work"/dist/cpshard-*.tar.gz)
"$py" - "$sdist" <<'PY'
import sys, tarfile
names = [n.split("/", 1)[1] for n in tarfile.open(sys.argv[1]).getnames() if "/" in n]
need = ["CMakeLists.txt", "setup.py", "pyproject.toml", "csrc/bindings.cpp",
        "csrc/comm/nccl_communicator.cpp", "csrc/ragged/ragged_cuda.cu", "cpshard/__init__.py",
        "cpshard/py.typed"]
missing = [n for n in need if n not in names]
assert not missing, f"the sdist lacks {missing}"
built = [n for n in names if n.endswith((".so", ".pyc", ".o"))]
assert not built, f"the sdist carries built files {built}"
print(f"   {sys.argv[1].rsplit('/', 1)[1]}: {len(names)} entries,",
      sum(n.startswith("csrc/") for n in names), "under csrc/")
PY

smoke() {
  (cd "$work/run" && "$py" - <<'PY'
import pathlib

import torch

import cpshard
from cpshard import _C

here = pathlib.Path(cpshard.__file__).resolve()
assert "site-packages" in here.parts, f"imported {here}, not the installed package"
info = cpshard.build_info()
assert info.torch_version == ".".join(torch.__version__.split(".")[:2]), info
x = torch.arange(10.0).reshape(5, 2)
packed = torch.ops.cpshard.pack_ragged(x, [2, 3], 0, 3, -1.0)
assert packed.shape == (2, 3, 2) and packed[0, 2].eq(-1).all()
assert torch.equal(torch.ops.cpshard.unpack_ragged(packed, [2, 3], 0, 3, [5, 2]), x)
q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
assert torch.allclose(cpshard.cp_attention(q, q, q, is_causal=True), ref)
print("   smoke test passed:", here.parent, info)
PY
  )
  # the installed console script (its entry point) and `python -m cpshard` dispatch
  (cd "$work/run" && "$work/venv/bin/cpshard" env >"$work/env.txt" && "$py" -m cpshard --help >/dev/null)
  sed -n 2,3p "$work/env.txt"
}

stamp "pip install the sdist (builds the extension from the archive)"
"$work/venv/bin/pip" install -q --no-build-isolation --no-deps "$sdist" > "$work/install.log" 2>&1 \
  || { tail -n 40 "$work/install.log"; fail "installing the sdist failed"; }
smoke

stamp "pip wheel from the sdist, then install the wheel in its place"
"$work/venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$work/dist" "$sdist" > "$work/wheel.log" 2>&1 \
  || { tail -n 40 "$work/wheel.log"; fail "building the wheel failed"; }
wheel=$(ls "$work"/dist/cpshard-*.whl)
"$py" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.startswith("cpshard/_C") and n.endswith(".so") for n in names), "no _C in the wheel"
assert "cpshard/py.typed" in names and not any(n.startswith(("csrc/", "tests/")) for n in names)
print(f"   {sys.argv[1].rsplit('/', 1)[1]}: {len(names)} files")
PY
"$work/venv/bin/pip" uninstall -q -y cpshard
"$work/venv/bin/pip" install -q --no-deps "$wheel"
smoke
stamp "release check passed"
