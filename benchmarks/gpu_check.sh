#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go (under 10 minutes on an H200):
# build with the CUDA handler, run the GPU tests, then check (forward and
# gradients against float64 / float32) and time (benchmarks/gpu.py: prefill and
# decode vs ragged_dot and dense, quantized decode, training step).  Logs go to the folder given as $1 or $JAX_NBX_BENCH_OUT
# (default ./gpu_logs); the table is printed last.
#   usage: bash benchmarks/gpu_check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${1:-${JAX_NBX_BENCH_OUT:-gpu_logs}}
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi; grep -m1 'model name' /proc/cpuinfo; nproc
  echo "cpu flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|avx512_vnni|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  $PY -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"; } \
  > "$LOGS/machine.txt" 2>&1
head -3 "$LOGS/machine.txt"; tail -1 "$LOGS/machine.txt"
echo "== build (CUDA handler required)"
t0=$(date +%s)
if ! $PY -m pip install --no-build-isolation --no-deps -e . --config-settings=cmake.define.NBX_CUDA=ON \
    > "$LOGS/build.log" 2>&1; then
  tail -40 "$LOGS/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
echo "== GPU tests"
timeout 150 $PY -m pytest -q --maxfail=5 tests/test_cuda.py -p no:cacheprovider > "$LOGS/tests.log" 2>&1
echo "pytest exit $?"; tail -15 "$LOGS/tests.log"
echo "== CPU micro-kernels of every ISA this machine's CPU has (its flags: machine.txt)"
timeout 90 $PY -m pytest -q tests/test_kernels.py -p no:cacheprovider > "$LOGS/cpu_kernels.log" 2>&1
echo "pytest exit $?"; tail -3 "$LOGS/cpu_kernels.log"
echo "== check and time"
timeout 300 $PY benchmarks/gpu.py --out "$LOGS" --bench-seconds ${GPU_BENCH_SECONDS:-120} ${GPU_BENCH_ARGS:-} 2>&1 | tee "$LOGS/bench.log" | grep -v "^\[" | tail -80
