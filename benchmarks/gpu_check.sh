#!/usr/bin/env bash
# The prepared check for a machine with one GPU: build the CUDA extension in place, run the GPU
# tests (tests/test_gpu.py and the CUDA-parametrized op tests), the kernel benchmark on the GPU
# and on the CPU (for reference), and the NCCL benchmark at world size 1 (NCCL refuses two ranks
# on one GPU; `cpshard bench` needs 2+ GPUs and is not run here).
# Every step's output goes to OUT (default $OUT or ./gpu-check): build.log, tests.txt,
# benchmarks.txt, kernels_cuda.json, kernels_cpu.json, nccl_world1.json and summary.txt (one
# PASS/FAIL line a step). A failing step does not stop the later ones; the exit status is 0 only
# when every step passed.
# Usage: benchmarks/gpu_check.sh [OUT]    (PYTHON picks the interpreter, default python3)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$repo/gpu-check}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$repo"
py=${PYTHON:-python3}
export CPSHARD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
for log in build.log tests.txt benchmarks.txt summary.txt; do : > "$out/$log"; done
failed=()

# step NAME LOG CMD...: run CMD, its output shown and appended to OUT/LOG; record PASS or FAIL.
step() {
    local name=$1 log=$out/$2 start=$SECONDS
    shift 2
    echo "== $name: $*" | tee -a "$log"
    if "$@" 2>&1 | tee -a "$log"; then
        echo "PASS $name ($((SECONDS - start)) s)" | tee -a "$out/summary.txt"
    else
        echo "FAIL $name ($((SECONDS - start)) s)" | tee -a "$out/summary.txt"
        failed+=("$name")
    fi
}

# Install only what the build and the GPU tests need and this Python lacks (the GPU machine may
# have no network).
deps() {
    local missing=() pair
    for pair in ninja:ninja "cmake:cmake>=3.26" pytest:pytest; do
        "$py" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
    done
    if ((${#missing[@]})); then
        "$py" -m pip install -q "${missing[@]}"
    fi
}

gpu_tests=("$py" -m pytest -q -p no:cacheprovider -m gpu)
step deps build.log deps
step nvidia-smi build.log nvidia-smi
step build build.log "$py" setup.py build_ext --inplace
step build_info build.log "$py" -c "import cpshard, torch; i = cpshard.build_info(); print(i)
assert torch.cuda.is_available(), 'torch sees no GPU'
assert i.cuda_kernels and i.nccl, 'not the CUDA + NCCL build'"
step gpu_tests tests.txt "${gpu_tests[@]}" tests/test_gpu.py tests/test_ops.py
step kernels_cuda benchmarks.txt \
    "$py" benchmarks/kernels.py --device cuda --json "$out/kernels_cuda.json"
step kernels_cpu benchmarks.txt "$py" benchmarks/kernels.py --json "$out/kernels_cpu.json"
step nccl_world1 benchmarks.txt "$py" benchmarks/nccl_world1.py --json "$out/nccl_world1.json"
# torch.compile on CUDA (inductor builds Triton kernels): the slowest step, so the last.
step gpu_compile_tests tests.txt "${gpu_tests[@]}" tests/test_ops_compile.py

echo "results in $out"
if ((${#failed[@]})); then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
