#!/usr/bin/env bash
# The CUDA path on a GPU machine, in one go, in priority order within a deadline
# (GPU_CHECK_SECONDS, default 540: the device tool allows 600 s per command; leave the
# session's device time room for a rerun).  Each stage's timeout is cut to what is left.
#   1. build, the CUDA handler required;
#   2. rows: one test per row of the CUDA status (benchmarks/gpu_rows.txt), each result logged
#      as it ends and a table of rows printed;
#   3. timing: benchmarks/gpu.py --skip-checks (prefill and decode vs ragged_dot, dense and the
#      anchors; quantized decode; the training step);
#   4. sweeps: the rest of the GPU tests and of the shared suite on the "cuda" runner, and gpu.py's
#      larger correctness cases; beside them, on the host CPU, the CPU micro-kernels of every ISA
#      it has (tests/cpu/test_kernels.py, test_precision.py: AMX hosts and avx512_fp16 show here);
#   5. if at least 200 s are left: tuning (tune_gpu.py, OLMoE and Qwen3 at T=4096, written to
#      $LOGS/tuned_configs.json: copy it to jax_nbx/backends/cuda/configs/<device>.json to keep it)
#      and those rows timed again with the tuned configs.
# Kernels come from the cubin cache JAX_NBX_CUBIN_CACHE (default ./gpu_cubins, carried along: fill
# it on a CPU machine with `python benchmarks/gpu_precompile.py` under Triton 3.6.0, the GPU
# machines'); "cubins compiled here" counts the cache's misses.
# GPU_CHECK_REHEARSAL=1 runs the same script on a machine without a GPU: no build (the installed
# module), the rows and sweeps on the "cuda-interpret" runner with their programs recorded, gpu.py
# on a small model on the CPU, no tuning, and at the end the cache checked for every kernel the
# run's programs named (gpu_precompile.py --check).
# Logs go to $1 or $JAX_NBX_BENCH_OUT (default ./gpu_logs); the tables are printed last.
#   usage: bash benchmarks/gpu_check.sh [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${1:-${JAX_NBX_BENCH_OUT:-gpu_logs}}
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$(( START + ${GPU_CHECK_SECONDS:-540} ))
REHEARSAL=${GPU_CHECK_REHEARSAL:-0}
# left CAP: the seconds a stage may take, at most CAP and what is left before the deadline
left() { local l=$(( DEADLINE - $(date +%s) )); (( l < $1 )) && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
since() { echo "$(( $(date +%s) - START )) s"; }
{ date -u; nvidia-smi 2>&1 | head -20; grep -m1 'model name' /proc/cpuinfo; nproc
  echo "cpu flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|avx512_vnni|amx_bf16|amx_int8|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  git log --oneline -1 2>/dev/null
  $PY -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"; } \
  > "$LOGS/machine.txt" 2>&1
head -3 "$LOGS/machine.txt"; tail -2 "$LOGS/machine.txt"
if [[ $REHEARSAL == 1 ]]; then
  echo "== REHEARSAL: no GPU; the CUDA programs under Triton's interpreter"
  RUNNER=cuda-interpret; WORKERS=2
  export TRITON_INTERPRET=1 JAX_NBX_KERNEL_RECORD=$(cd "$LOGS" && pwd)/kernels
  rm -rf "$JAX_NBX_KERNEL_RECORD"
else
  RUNNER=cuda; WORKERS=8
  echo "== build (CUDA handler required)"
  if ! CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "$(left 240)" $PY -m pip install --no-build-isolation --no-deps -e . \
      --config-settings=cmake.define.NBX_CUDA=ON --config-settings=cmake.define.NBX_TESTING=ON \
      > "$LOGS/build.log" 2>&1; then
    tail -40 "$LOGS/build.log"; echo "BUILD FAILED"; exit 1
  fi
  echo "built after $(since)"
fi
export JAX_NBX_CUBIN_CACHE=${JAX_NBX_CUBIN_CACHE:-$PWD/gpu_cubins}
cubins() { ls "$JAX_NBX_CUBIN_CACHE" 2>/dev/null | grep -c '\.cubin$'; }
CUBINS_BEFORE=$(cubins)
echo "== cubin cache $JAX_NBX_CUBIN_CACHE: $CUBINS_BEFORE cubins"
# the rows' node ids, for this runner (the suite's ids name it)
mapfile -t ROW_IDS < <(grep -v '^#' benchmarks/gpu_rows.txt | cut -f2 | sed "s/\[cuda-/[$RUNNER-/")
PER_TEST=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${GPU_TEST_TIMEOUT:-60}")
gpu_pytest() {  # LOG CAP pytest-args...: -v, so each test's result is in the log as it ends
  local log=$1 cap=$2; shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=${GPU_TEST_MEM_FRACTION:-0.08} timeout "$(left "$cap")" \
    $PY -m pytest -v -n $WORKERS -rfE --durations=10 $PER_TEST -p no:cacheprovider --backends "$RUNNER" "$@" \
    > "$LOGS/$log" 2>&1
  echo "pytest exit $? after $(since); $(grep -c ' PASSED' "$LOGS/$log") passed, $(grep -c ' FAILED' "$LOGS/$log") failed," \
    "$(grep -c ' SKIPPED' "$LOGS/$log") skipped; cubins compiled here so far: $(( $(cubins) - CUBINS_BEFORE ))"
}
echo "== rows: one test per row ($(( DEADLINE - $(date +%s) )) s left)"
gpu_pytest rows.log ${GPU_ROWS_SECONDS:-150} "${ROW_IDS[@]}"
# the rows' table: row, then the result its test logged (none: it did not end in time)
while IFS=$'\t' read -r row id; do
  id=${id/\[cuda-/[$RUNNER-}
  res=$(grep -F -- "$id " "$LOGS/rows.log" | grep -o -E 'PASSED|FAILED|SKIPPED|ERROR' | head -1)
  printf '%-36s %s\n' "$row" "${res:-NOT RUN}"
done < <(grep -v '^#' benchmarks/gpu_rows.txt) | tee "$LOGS/rows_table.txt"
echo "== timing ($(( DEADLINE - $(date +%s) )) s left)"
# gpu.py keeps its own deadline (a little inside the stage's) and writes its tables after
# every section, so a cut-off run still leaves LOGS/gpu_table.md
T_GPU=$(left ${GPU_TIMING_SECONDS:-200})
if [[ $REHEARSAL == 1 ]]; then
  BENCH_ARGS="--models granite-3.0-1b-a400m --tokens 1,16 --quant-tokens 1 --train-tokens 16 --gemm-n 256 --copy-mib 8"
else
  BENCH_ARGS=${GPU_BENCH_ARGS:-}
fi
timeout "$T_GPU" $PY benchmarks/gpu.py --skip-checks --out "$LOGS" --bench-seconds ${GPU_BENCH_SECONDS:-120} \
  --deadline-seconds $(( T_GPU > 40 ? T_GPU - 15 : T_GPU )) $BENCH_ARGS > "$LOGS/bench.log" 2>&1
echo "gpu.py exit $? after $(since)"; tail -30 "$LOGS/bench.log"
echo "== sweeps: the rest of the tests ($(( DEADLINE - $(date +%s) )) s left); the CPU micro-kernels beside them"
timeout "$(left 120)" $PY -m pytest -q -n 4 tests/cpu/test_kernels.py tests/cpu/test_precision.py -p no:cacheprovider \
  > "$LOGS/cpu_kernels.log" 2>&1 &
CPU_PID=$!
DESELECT=(); for id in "${ROW_IDS[@]}"; do DESELECT+=(--deselect "$id"); done
gpu_pytest sweeps.log ${GPU_SWEEP_SECONDS:-200} tests/cuda/test_cuda_gpu.py tests/suite "${DESELECT[@]}"
grep -E " (FAILED|ERROR)" "$LOGS/rows.log" "$LOGS/sweeps.log" | cut -c1-300 | head -30
wait $CPU_PID; echo "CPU micro-kernels: pytest exit $?; $(tail -1 "$LOGS/cpu_kernels.log")"
if [[ $REHEARSAL != 1 ]] && (( DEADLINE - $(date +%s) >= 60 )); then
  timeout "$(left 90)" $PY benchmarks/gpu.py --check-only --out "$LOGS/checks" > "$LOGS/checks.log" 2>&1
  echo "gpu.py --check-only exit $?"; grep -E "FAIL|ERROR" "$LOGS/checks.log" | head -10
fi
if [[ $REHEARSAL != 1 ]] && (( DEADLINE - $(date +%s) >= 200 )); then
  echo "== tuning OLMoE and Qwen3 at T=4096 ($(( DEADLINE - $(date +%s) )) s left)"
  timeout "$(left 150)" $PY benchmarks/tune_gpu.py --models olmoe-1b-7b,qwen3-30b-a3b --tokens 4096 \
    --budget-seconds 110 --out "$LOGS/tuned_configs.json" > "$LOGS/tune.log" 2>&1
  tail -4 "$LOGS/tune.log"
  JAX_NBX_TRITON_CONFIGS="$LOGS/tuned_configs.json" timeout "$(left 90)" $PY benchmarks/gpu.py --skip-checks \
    --models olmoe-1b-7b,qwen3-30b-a3b --tokens 4096 --quant-tokens "" --train-tokens "" \
    --out "$LOGS/after_tuning" 2>&1 | tee "$LOGS/after_tuning.log" | tail -8
elif [[ $REHEARSAL == 1 ]]; then
  echo "== tuning: not rehearsed (it times compiled kernels on a GPU)"
else
  echo "== tuning skipped ($(( DEADLINE - $(date +%s) )) s left; it takes 200)"
fi
if [[ $REHEARSAL == 1 ]]; then
  echo "== the cache against every kernel this run's programs named"
  unset TRITON_INTERPRET
  $PY benchmarks/gpu_precompile.py --records "$JAX_NBX_KERNEL_RECORD" --check --cache "$JAX_NBX_CUBIN_CACHE"
  echo "gpu_precompile --check exit $?"
fi
if [[ $REHEARSAL != 1 ]] && (( DEADLINE - $(date +%s) >= 60 )); then  # issue #19 on the host CPU
  echo "== CPU prefill, float32 vs precision=bfloat16 ($(( DEADLINE - $(date +%s) )) s left)"
  timeout "$(left 50)" $PY benchmarks/isa.py --models olmoe-1b-7b --rows prefill-f32,prefill-bf16dot,decode-bf16dot \
    --rounds 2 --json "$LOGS/isa_bf16dot.json" > "$LOGS/isa_bf16dot.log" 2>&1
  tail -8 "$LOGS/isa_bf16dot.log"
fi
echo "== rows"; cat "$LOGS/rows_table.txt"
echo "== done in $(since)"
