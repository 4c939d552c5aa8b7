#!/usr/bin/env bash
# The prepared check for a fresh machine with one or more GPUs, in one shot: build the CUDA
# extension in place (for this GPU's architecture only), then the GPU tests
# (tests/ops/test_cuda_kernels.py and tests/comm/test_nccl.py: CUDA kernels vs CPU, the native
# NCCL communicator at world size 1 vs torch.distributed, and at
# world size 2 when two GPUs are visible; the CUDA-parametrized op tests), the steady-state
# transport and a cp_blockdiag_sdpa layer under torch.cuda.set_sync_debug_mode("error") (world
# size 1, and every visible GPU up to 4 when there are two or more: NCCL refuses two ranks on one
# GPU), the NCCL benchmark at world size 1, the kernel benchmark on the GPU and on the CPU, and
# torch.compile of the ops on CUDA.
#
# Every step runs under its own `timeout` and within an overall budget (BUDGET_S, default 470 s:
# the whole check fits in 8 minutes with the build); a step that no longer fits is SKIPped. One
# PASS / FAIL / SKIP line per step goes to summary.txt, a failing step does not stop the later
# ones. Exit status: 0 only when every step ran and passed, 1 when a step failed, 2 when none
# failed but the budget ran out before some ran (summary.txt then says INCOMPLETE): a green
# check means every step ran. Supported: torch 2.11 to 2.15 (the lent machine's image:
# 2.11.0+cu130, Python 3.12, no network). The build needs no network when
# ninja, CMake >= 3.26 and pytest are installed (the deps step installs only what is missing);
# its CMake/ninja tree stays in build/ of this checkout, so a rerun recompiles only what changed.
# Numeric checks (scripts/gpu/numerics.py): fp16/bf16 cp_attention on the varlen and loop paths
# against an fp32 reference within a multiple of the reference's own low-precision error, the
# same for a sliding window, sinks and logit soft-capping (alone and together), and GQA with
# single-token query runs against float64.
# Output goes to OUT (argument, else $OUT, else ./gpu-check): build.log, tests.txt,
# steady_state.txt, benchmarks.txt, kernels_cuda.json, kernels_cpu.json, nccl_world1.json,
# summary.txt.
# Usage: scripts/gpu/check.sh [OUT]    (PYTHON picks the interpreter, default python3)
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-${OUT:-$repo/gpu-check}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$repo"
py=${PYTHON:-python3}
budget=${BUDGET_S:-470}
export CPSHARD_CUDA=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
for log in build.log tests.txt steady_state.txt benchmarks.txt summary.txt; do : > "$out/$log"; done
failed=()
skipped=()

# step NAME LOG LIMIT_S CMD...: run CMD under `timeout` (LIMIT_S, cut to what is left of the
# budget), its output shown and appended to OUT/LOG; record PASS, FAIL or SKIP.
step() {
    local name=$1 log=$out/$2 limit=$3 start=$SECONDS left rc
    shift 3
    left=$((budget - SECONDS))
    if ((left < 20)); then
        echo "SKIP $name (budget spent)" | tee -a "$out/summary.txt"
        skipped+=("$name")
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (timeout ${limit} s): $*" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if ((rc == 0)); then
        echo "PASS $name ($((SECONDS - start)) s)" | tee -a "$out/summary.txt"
    else
        local why="exit $rc"
        ((rc == 124 || rc == 137)) && why="timed out after ${limit} s"
        echo "FAIL $name ($why, $((SECONDS - start)) s)" | tee -a "$out/summary.txt"
        failed+=("$name")
    fi
}

# Install only what the build and the tests need and this Python lacks (the machine may have no
# network: then this step fails and says so, and the build may still find the tools).
deps() {
    local missing=() pair
    for pair in ninja:ninja "cmake:cmake>=3.26" pytest:pytest numpy:numpy; do
        "$py" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
    done
    if ((${#missing[@]})); then
        "$py" -m pip install -q "${missing[@]}"
    fi
}

# Compile for this GPU only (a fat build for every architecture would not fit the budget).
arch=$("$py" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${arch:-9.0}}
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
wide=$((gpus > 4 ? 4 : gpus))
echo "torch $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1)," \
    "$gpus GPU(s), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, budget ${budget} s" | tee -a "$out/summary.txt"

tests=("$py" -m pytest -q -p no:cacheprovider -rfEs)
export py
export -f deps  # `timeout` runs programs, not shell functions
step deps build.log 120 bash -c deps
step nvidia-smi build.log 30 nvidia-smi
step build build.log 330 env MAX_JOBS=${MAX_JOBS:-$(nproc)} "$py" setup.py build_ext --inplace
step build_info build.log 60 "$py" -c "import cpshard, torch; i = cpshard.build_info(); print(i)
assert torch.cuda.is_available(), 'torch sees no GPU'
assert i.cuda_kernels and i.nccl, 'not the CUDA + NCCL build'"
step gpu_tests tests.txt 150 "${tests[@]}" tests/ops/test_cuda_kernels.py tests/comm/test_nccl.py
step numerics tests.txt 90 "$py" scripts/gpu/numerics.py
step steady_state_w1 steady_state.txt 120 "$py" scripts/gpu/steady_state.py --world 1
if ((wide >= 2)); then
    step "steady_state_w$wide" steady_state.txt 150 "$py" scripts/gpu/steady_state.py --world "$wide"
fi
step nccl_world1 benchmarks.txt 90 "$py" -m cpshard.bench.nccl_world1 --json "$out/nccl_world1.json"
step gpu_op_tests tests.txt 150 "${tests[@]}" -m gpu tests/ops/test_ops.py
step kernels_cuda benchmarks.txt 120 \
    "$py" -m cpshard.bench.kernels --device cuda --json "$out/kernels_cuda.json"
step kernels_cpu benchmarks.txt 90 "$py" -m cpshard.bench.kernels --json "$out/kernels_cpu.json"
# torch.compile on CUDA (inductor builds Triton kernels): the slowest step, so the last.
step gpu_compile_tests tests.txt 180 "${tests[@]}" -m gpu tests/ops/test_ops_compile.py

if ((${#skipped[@]})); then
    echo "INCOMPLETE: the budget (${budget} s) ran out before ${skipped[*]}" >> "$out/summary.txt"
fi
echo "results in $out ($SECONDS s)" | tee -a "$out/summary.txt"
cat "$out/summary.txt"
if ((${#failed[@]})); then
    echo "failed: ${failed[*]}"
    exit 1
fi
((${#skipped[@]})) && exit 2
echo "every step ran and passed"
