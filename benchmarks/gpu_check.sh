#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go, within a deadline (GPU_CHECK_SECONDS,
# default 540: the device tool allows 600 s per command; set it so that the
# session's device time leaves room for a rerun):
#   1. build with the CUDA handler required;
#   2. the GPU tests (tests/cuda/test_cuda_gpu.py: forward, the CUDA backward, lists, quantized,
#      graphs, the deferred id check) and the shared suite on the "cuda" runner (tests/suite
#      --backends cuda: every layout, bias, format, band and gradient case the CPU handler
#      runs; its core cases, 75), in 8 processes that each take GPU_TEST_MEM_FRACTION (0.08) of
#      the GPU, within GPU_TEST_SECONDS (240: on 2026-12-04 an H200 ran 75 tests in 200 s);
#   3. the CPU micro-kernels of every ISA this machine's CPU has (tests/cpu/test_kernels.py) and
#      precision="bfloat16" through the op (tests/cpu/test_precision.py: the avx512_bf16 kernels
#      where the CPU has them);
#   4. benchmarks/gpu.py: forward and gradient checks against float64 / float32, then the
#      timing table (prefill and decode vs ragged_dot and dense and the anchors, quantized
#      decode, training step);
#   5. if at least 200 s are left (raise GPU_CHECK_SECONDS for it): benchmarks/tune_gpu.py on OLMoE and Qwen3 at T=4096
#      (writes $LOGS/tuned_configs.json; copy it to jax_nbx/backends/cuda/configs/<device>.json to
#      keep it) and those rows timed again with the tuned configs.
# Kernels: read from the cubin cache JAX_NBX_CUBIN_CACHE (default ./gpu_cubins: fill it on a CPU
# machine with `python benchmarks/gpu_precompile.py` under Triton 3.6.0, the GPU machines', and carry
# it along); what the tests still compile here is counted in "cubins compiled here" below.
# Each stage's timeout is cut to what is left of the deadline.  Logs go to the folder
# given as $1 or $JAX_NBX_BENCH_OUT (default ./gpu_logs); the tables are printed last.
#   usage: bash benchmarks/gpu_check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${1:-${JAX_NBX_BENCH_OUT:-gpu_logs}}
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$(( START + ${GPU_CHECK_SECONDS:-540} ))
# left CAP: the seconds a stage may take, at most CAP and what is left before the deadline
left() { local l=$(( DEADLINE - $(date +%s) )); (( l < $1 )) && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
{ date -u; nvidia-smi; grep -m1 'model name' /proc/cpuinfo; nproc
  echo "cpu flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|avx512_vnni|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  git log --oneline -1 2>/dev/null
  $PY -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"; } \
  > "$LOGS/machine.txt" 2>&1
head -3 "$LOGS/machine.txt"; tail -1 "$LOGS/machine.txt"
echo "== build (CUDA handler required)"
if ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "$(left 240)" $PY -m pip install --no-build-isolation --no-deps -e . \
    --config-settings=cmake.define.NBX_CUDA=ON --config-settings=cmake.define.NBX_TESTING=ON \
    > "$LOGS/build.log" 2>&1; then
  tail -40 "$LOGS/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - START )) s"
export JAX_NBX_CUBIN_CACHE=${JAX_NBX_CUBIN_CACHE:-$PWD/gpu_cubins}
cubins() { ls "$JAX_NBX_CUBIN_CACHE" 2>/dev/null | grep -c '\.cubin$'; }
CUBINS_BEFORE=$(cubins)
echo "== cubin cache $JAX_NBX_CUBIN_CACHE: $CUBINS_BEFORE cubins"
echo "== GPU tests and the shared suite on the cuda runner"
# -v: each test's name and result as it ends (a run cut off by its stage's timeout still
# shows how far it got); a per-test timeout where pytest-timeout is installed (the image has it).
PER_TEST=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${GPU_TEST_TIMEOUT:-60}")
XLA_PYTHON_CLIENT_MEM_FRACTION=${GPU_TEST_MEM_FRACTION:-0.08} timeout "$(left ${GPU_TEST_SECONDS:-240})" \
  $PY -m pytest -v -n 8 -rfE --maxfail=25 --durations=15 $PER_TEST tests/cuda/test_cuda_gpu.py tests/suite \
  --backends cuda -p no:cacheprovider > "$LOGS/tests.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - START )) s; $(grep -c ' PASSED' "$LOGS/tests.log") passed;" \
  "cubins compiled here: $(( $(cubins) - CUBINS_BEFORE )) (the cache's misses)"
grep -E "^(FAILED|ERROR)| (FAILED|ERROR) " "$LOGS/tests.log" | cut -c1-300 | head -30
tail -3 "$LOGS/tests.log"
echo "== CPU micro-kernels of every ISA this machine's CPU has (its flags: machine.txt)"
timeout "$(left 60)" $PY -m pytest -q tests/cpu/test_kernels.py tests/cpu/test_precision.py -p no:cacheprovider \
  > "$LOGS/cpu_kernels.log" 2>&1
echo "pytest exit $?"; tail -3 "$LOGS/cpu_kernels.log"
echo "== check and time ($(( DEADLINE - $(date +%s) )) s left)"
# gpu.py keeps its own deadline (a little inside the stage's) and writes its tables after
# every section, so a cut-off run still leaves LOGS/gpu_table.md
T_GPU=$(left 300)
timeout "$T_GPU" $PY benchmarks/gpu.py --out "$LOGS" --bench-seconds ${GPU_BENCH_SECONDS:-120} \
  --deadline-seconds $(( T_GPU > 40 ? T_GPU - 15 : T_GPU )) ${GPU_BENCH_ARGS:-} 2>&1 | tee "$LOGS/bench.log" | tail -80
if (( DEADLINE - $(date +%s) >= 200 )); then
  echo "== tuning OLMoE and Qwen3 at T=4096 ($(( DEADLINE - $(date +%s) )) s left)"
  timeout "$(left 150)" $PY benchmarks/tune_gpu.py --models olmoe-1b-7b,qwen3-30b-a3b --tokens 4096 \
    --budget-seconds 110 --out "$LOGS/tuned_configs.json" > "$LOGS/tune.log" 2>&1
  tail -4 "$LOGS/tune.log"
  JAX_NBX_TRITON_CONFIGS="$LOGS/tuned_configs.json" timeout "$(left 90)" $PY benchmarks/gpu.py --skip-checks \
    --models olmoe-1b-7b,qwen3-30b-a3b --tokens 4096 --quant-tokens "" --train-tokens "" \
    --out "$LOGS/after_tuning" 2>&1 | tee "$LOGS/after_tuning.log" | tail -8
else
  echo "== tuning skipped: under 200 s left"
fi
if (( DEADLINE - $(date +%s) >= 60 )); then  # issue #19 on this machine's CPU: f32 vs bf16 dot prefill
  echo "== CPU prefill, float32 vs precision=bfloat16 ($(( DEADLINE - $(date +%s) )) s left)"
  timeout "$(left 50)" $PY benchmarks/isa.py --models olmoe-1b-7b --rows prefill-f32,prefill-bf16dot,decode-bf16dot \
    --rounds 2 --json "$LOGS/isa_bf16dot.json" > "$LOGS/isa_bf16dot.log" 2>&1
  tail -8 "$LOGS/isa_bf16dot.log"
fi
echo "== done in $(( $(date +%s) - START )) s"
