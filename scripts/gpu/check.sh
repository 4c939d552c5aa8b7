#!/usr/bin/env bash
# The prepared check for a lent GPU machine (one GPU is enough), staged to fit a short lease (the
# whole run within BUDGET_S, default 330 s, on 16 cores), each stage timed, its result written
# to OUT/stage_<name>.json the moment it ends (so a lease cut short still leaves every finished
# stage's result), and one PASS / FAIL / SKIP line per stage in OUT/summary.txt:
#
#   1. smoke        torch alone: an NCCL all-reduce at world size 1 (tells the machine's problems
#                   from cpshard's; NCCL at one rank is a copy: a smoke test, nothing more);
#   2. build        the CUDA extension for this GPU's architecture only, and its build info;
#   3. correctness  W = 2 and 4 ranks on the one GPU with CUDA tensors and the transport through
#                   gloo staged through host memory: the strategies, window / sinks / soft-cap,
#                   torch.compile, the steady state under set_sync_debug_mode("error") and
#                   CUDA-graph capture, bf16 against float64 within a multiple of the plain bf16
#                   reference's own error (scripts/gpu/stages.py, OUT/correctness.json); then
#                   the native NCCL verbs and a layer under the sync check at world size 1
#                   (scripts/gpu/steady_state.py), fp16 / bf16 numerics of both attention paths
#                   (scripts/gpu/numerics.py), the CUDA kernels against the CPU ones and the
#                   native NCCL communicator at world size 1 (tests/ops/test_cuda_kernels.py,
#                   tests/comm/test_nccl.py);
#   4. bench        one CP layer step at W = 2 sharing the GPU and the varlen attention against
#                   per-document SDPA (OUT/bench.json), the kernels against copy bandwidth
#                   (OUT/kernels_cuda.json), the per-call cost of each native verb against
#                   torch's all_gather_into_tensor / reduce_scatter_tensor (OUT/nccl_world1.json).
#                   No CPU benchmark.
#
# A stage that no longer fits the budget is SKIPped; a failing stage does not stop the later
# ones. Exit status: 0 only when every stage ran and passed, 1 when one failed, 2 when none failed
# but the budget ran out first (summary.txt then says INCOMPLETE).
#
# --dry-run runs every stage's logic on CPU (CPU tensors, gloo, no build: the installed
# extension's build info; timings labelled dry-run), in about a minute: CI runs it.
# The lent machine's image: torch 2.11.0+cu130, Python 3.12, nvcc 13.0, CMake, ninja, pybind11,
# pytest, hypothesis, transformers 5.17, no network (nothing is installed here).
# Usage: scripts/gpu/check.sh [--dry-run] [OUT]   (OUT default $OUT, else ./gpu-check;
#        PYTHON picks the interpreter, default python3)
set -uo pipefail
dry=0
if [[ "${1:-}" == "--dry-run" ]]; then
    dry=1
    shift
fi
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-${OUT:-$repo/gpu-check}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$repo"
py=${PYTHON:-python3}
budget=${BUDGET_S:-330}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((dry ? 1 : 2))}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
: > "$out/summary.txt"
: > "$out/log.txt"
failed=()
skipped=()

# stage NAME LIMIT_S CMD...: run CMD under `timeout` (LIMIT_S, cut to what is left of the
# budget), its output appended to OUT/log.txt; record PASS, FAIL or SKIP in summary.txt and in
# OUT/stage_NAME.json as soon as it ends.
stage() {
    local name=$1 limit=$2 start=$SECONDS left rc status why=""
    shift 2
    left=$((budget - SECONDS))
    if ((left < 10)); then
        echo "SKIP $name (budget spent)" | tee -a "$out/summary.txt"
        printf '{"stage": "%s", "status": "SKIP", "seconds": 0}\n' "$name" > "$out/stage_$name.json"
        skipped+=("$name")
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (timeout ${limit} s): $*" | tee -a "$out/log.txt"
    timeout --kill-after=10 "$limit" "$@" >> "$out/log.txt" 2>&1
    rc=$?
    if ((rc == 0)); then
        status=PASS
    else
        status=FAIL
        why="exit $rc"
        ((rc == 124 || rc == 137)) && why="timed out after ${limit} s"
        failed+=("$name")
    fi
    echo "$status $name ($((SECONDS - start)) s${why:+, $why})" | tee -a "$out/summary.txt"
    printf '{"stage": "%s", "status": "%s", "seconds": %d, "exit": %d, "dry_run": %s}\n' \
        "$name" "$status" $((SECONDS - start)) "$rc" "$([[ $dry == 1 ]] && echo true || echo false)" \
        > "$out/stage_$name.json"
}

stages=("$py" scripts/gpu/stages.py)
tests=("$py" -m pytest -q -p no:cacheprovider -rfEs)
if ((dry)); then
    echo "dry run on CPU: $("$py" -c 'import torch; print("torch", torch.__version__)' 2>&1)," \
        "budget ${budget} s" | tee -a "$out/summary.txt"
    stage smoke 60 "${stages[@]}" smoke --device cpu --out "$out"
    stage build 60 "$py" -c "import cpshard; print(cpshard.build_info())"
    stage correctness 240 "${stages[@]}" correctness --device cpu --out "$out"
    stage bench 120 "${stages[@]}" bench --device cpu --repeats 1 --out "$out"
else
    arch=$("$py" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null)
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${arch:-9.0}}
    echo "torch $("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1)," \
        "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, budget ${budget} s" | tee -a "$out/summary.txt"
    stage smoke 45 "${stages[@]}" smoke --out "$out"
    stage build 150 bash -c "CPSHARD_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} '$py' setup.py build_ext --inplace \
        && '$py' -c \"import cpshard, torch; i = cpshard.build_info(); print(i)
assert torch.cuda.is_available(), 'torch sees no GPU'
assert i.cuda_kernels and i.nccl, 'not the CUDA + NCCL build'\""
    stage correctness 150 bash -c "'$py' scripts/gpu/stages.py correctness --out '$out' \
        && '$py' scripts/gpu/steady_state.py --world 1 && '$py' scripts/gpu/numerics.py \
        && ${tests[*]} tests/ops/test_cuda_kernels.py tests/comm/test_nccl.py"
    stage bench 60 bash -c "'$py' scripts/gpu/stages.py bench --out '$out' \
        && '$py' -m cpshard.bench.kernels --device cuda --size-mib 16 --repeats 5 --json '$out/kernels_cuda.json' \
        && '$py' -m cpshard.bench.nccl_world1 --repeats 20 --json '$out/nccl_world1.json'"
fi

if ((${#skipped[@]})); then
    echo "INCOMPLETE: the budget (${budget} s) ran out before ${skipped[*]}" >> "$out/summary.txt"
fi
echo "results in $out ($SECONDS s)" | tee -a "$out/summary.txt"
if ((${#failed[@]})); then
    echo "failed: ${failed[*]}"
    exit 1
fi
((${#skipped[@]})) && exit 2
echo "every stage ran and passed"
