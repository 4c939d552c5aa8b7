#!/usr/bin/env bash
# The prepared check for a machine with one GPU: build the CUDA extension in place, run the GPU
# tests and the kernel benchmark, write everything to OUT (default $OUT or ./gpu-check).
# NCCL refuses two ranks on one GPU, so the communicator is checked at world size 1 (tests/test_gpu.py).
# Usage: benchmarks/gpu_check.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
python -m pip install -q ninja "cmake>=3.26" pytest hypothesis expecttest numpy 2>&1 | tail -n 3
export CPSHARD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
{ time python setup.py build_ext --inplace; } > "$out/build.log" 2>&1
python -c "import cpshard; print(cpshard.build_info())" | tee "$out/build_info.txt"
python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_ops.py -k "cuda or gpu or Cuda" 2>&1 | tee "$out/gpu_tests.txt"
python -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee -a "$out/gpu_tests.txt"
python benchmarks/kernels.py --json "$out/kernels_cpu.json" 2>&1 | tee "$out/kernels_cpu.txt"
echo "results in $out"
