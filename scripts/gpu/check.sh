#!/usr/bin/env bash
# The prepared check for a lent GPU machine (one GPU is enough), for a fresh clone on an
# interpreter without cpshard: staged to fit a short lease (the whole run within BUDGET_S,
# default 360 s, on 16 cores), ordered by the value of what each stage proves, each stage under
# its own time limit, its result written to OUT/stage_<name>.json the moment it ends (so a lease
# cut short still leaves every finished stage's result) with its own JSON beside it, and one
# PASS / FAIL / SKIP line per stage in OUT/summary.txt (with the stage's last output line: a
# test count, or what was skipped and why):
#
#   smoke         torch alone (nothing of cpshard is built yet): an NCCL all-reduce at world
#                 size 1, and the machine's facts: the device, torch's NCCL, which attention
#                 kernels torch's flash op and SDPA launch there and whether FlashAttention-3 /
#                 -4 can serve them (scripts/gpu/smoke.py, machine.py; OUT/smoke.json);
#   build         the extension built in place (CUDA + NCCL for this GPU's architecture only),
#                 imported from this checkout, its build info (scripts/gpu/build.py;
#                 OUT/build.json);
#   kernels       the CUDA kernels against the CPU ones (tests/ops/test_cuda_kernels.py);
#   nccl          the native NCCL communicator at world size 1 (tests/comm/test_nccl.py);
#   steady_state  the native NCCL verbs and a layer under the sync check at world size 1, the
#                 NCCL libraries loaded (scripts/gpu/steady_state.py; OUT/steady_state.json);
#   correctness   W = 2 and 4 ranks on the one GPU, CUDA tensors, the transport through gloo
#                 staged through host memory: the strategies, window / sinks / soft-cap, a mixer,
#                 bf16 against float64 within a multiple of the plain bf16 reference's own
#                 error, the steady state under the sync check (OUT/correctness.json);
#   numerics      fp16 / bf16 of both attention paths at world size 1 (OUT/numerics.json);
#   bench         one CP layer step at W = 2 sharing the GPU, the varlen attention against
#                 per-document SDPA (OUT/bench.json);
#   bench_kernels the kernels against copy bandwidth (OUT/kernels_cuda.json);
#   bench_nccl    the per-call cost of each native verb against torch's collectives
#                 (OUT/nccl_world1.json);
#   compile       torch.compile (inductor) of the layer against eager at W = 2 (OUT/compile.json);
#   graph         CUDA-graph capture of a warmed layer at world size 1, replayed (OUT/graph.json).
#
# A stage that no longer fits the budget is SKIPped; a failing stage does not stop the later
# ones. Exit status: 0 only when every stage ran and passed, 1 when one failed, 2 when none failed
# but the budget ran out first (summary.txt then says INCOMPLETE).
#
# --dry-run emulates the lent machine on CPU: the same stages run the same scripts from the same
# fresh checkout (the build builds the CPU extension in place), only the device differs: CPU
# tensors, gloo, float32 as the low precision; what needs a GPU says so in its JSON (the sync
# check and the capture "not checked", the CUDA and NCCL tests skipped, nccl_world1 skipped).
# CI runs it from a fresh copy of the tree on an interpreter without cpshard
# (tests/scripts/test_gpu_check.py).
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
# the dry run's CPU (a shared 2-core CI machine) is not the lent machine's 16 cores: its build
# and stages get 6 x the time (limits there only stop a hang)
budget=${BUDGET_S:-$((dry ? 1500 : 360))}
scale=$((dry ? 6 : 1))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((dry ? 1 : 2))}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
: > "$out/summary.txt"
: > "$out/log.txt"
failed=()
skipped=()
dry_json=$( ((dry)) && echo true || echo false)

# stage NAME LIMIT_S CMD...: run CMD under `timeout` (LIMIT_S, times the scale, cut to what is
# left of the budget), its output appended to OUT/log.txt; record PASS, FAIL or SKIP, with CMD's
# last output line, in summary.txt and in OUT/stage_NAME.json as soon as it ends.
stage() {
    local name=$1 limit=$(($2 * scale)) start=$SECONDS left rc status why="" last
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
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/.stage.log" >> "$out/log.txt"
    rc=${PIPESTATUS[0]}
    last=$(grep -v '^[[:space:]]*$' "$out/.stage.log" | tail -n 1 | cut -c 1-160 \
        | tr -d '"\\' | tr -cd '[:print:]')
    rm -f "$out/.stage.log"
    if ((rc == 0)); then
        status=PASS
    else
        status=FAIL
        why="exit $rc"
        ((rc == 124 || rc == 137)) && why="timed out after ${limit} s"
        failed+=("$name")
    fi
    echo "$status $name ($((SECONDS - start)) s${why:+, $why})${last:+: $last}" \
        | tee -a "$out/summary.txt"
    printf '{"stage": "%s", "status": "%s", "seconds": %d, "exit": %d, "dry_run": %s, %s}\n' \
        "$name" "$status" $((SECONDS - start)) "$rc" "$dry_json" "\"last_line\": \"$last\"" \
        > "$out/stage_$name.json"
}

gpu=scripts/gpu
tests=("$py" -m pytest -q -p no:cacheprovider -rfEs)
if ((dry)); then
    device=cpu
    about='import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)'
    echo "dry run on CPU: $("$py" -c "$about" 2>&1)," \
        "budget ${budget} s" | tee -a "$out/summary.txt"
    kernels_bench=(--size-mib 1 --repeats 1 --warmup 1)
    repeats=1
else
    device=cuda
    arch=$("$py" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' \
        2>/dev/null)
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-${arch:-9.0}}
    about='import torch; print(torch.__version__, "CUDA", torch.version.cuda)'
    echo "torch $("$py" -c "$about" 2>&1)," \
        "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, budget ${budget} s" | tee -a "$out/summary.txt"
    export MAX_JOBS=${MAX_JOBS:-$(nproc)}
    kernels_bench=(--size-mib 16 --repeats 5)
    repeats=10
fi
on=(--device "$device")

stage smoke 45 "$py" $gpu/smoke.py "${on[@]}" --out "$out"
stage build 150 "$py" $gpu/build.py "${on[@]}" --out "$out"
stage kernels 60 "${tests[@]}" tests/ops/test_cuda_kernels.py
stage nccl 60 "${tests[@]}" tests/comm/test_nccl.py
stage steady_state 45 "$py" $gpu/steady_state.py --world 1 --json "$out/steady_state.json"
stage correctness 120 "$py" $gpu/stages.py correctness "${on[@]}" --out "$out"
stage numerics 60 "$py" $gpu/numerics.py "${on[@]}" --json "$out/numerics.json"
stage bench 60 "$py" $gpu/stages.py bench "${on[@]}" --repeats $repeats --out "$out"
stage bench_kernels 45 "$py" -m cpshard.bench.kernels "${on[@]}" "${kernels_bench[@]}" \
    --json "$out/kernels_$device.json"
stage bench_nccl 45 "$py" -m cpshard.bench.nccl_world1 --repeats 20 --json "$out/nccl_world1.json"
stage compile 150 "$py" $gpu/stages.py compile "${on[@]}" --out "$out"
stage graph 45 "$py" $gpu/stages.py graph "${on[@]}" --out "$out"

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
