#!/usr/bin/env bash
# On the GPU machine, in the repository root: install offline, run the CUDA tests, then the GPU benchmark.
# Everything it prints also lands in $OUT (the device tool brings that folder back). Run
# benchmarks/gpu_wheels.sh here first and carry .whl. Stages are time-boxed so that one stuck stage
# leaves the others' results:   bash benchmarks/gpu.sh [test-seconds] [bench-seconds] [gpu.py arguments...]
# (CUDA_TESTS=EXPR runs only the tests pytest's -k EXPR selects; RANKS_SECONDS=N (default 180) boxes
# tests/test_cuda_ranks.py, two gloo ranks sharing the card (ZeRO-3 and the pipeline), in a stage of its own after
# tests/test_cuda.py (skipped with it), CUDA_TESTS selecting there too; LARGEST_SECONDS=N then trains the largest model,
# benchmarks/largest.py --run with the arguments in LARGEST_ARGS, for at most N seconds; LLAMA_SECONDS=N runs gpu.py
# --model llama (the 8B shape) with the arguments in LLAMA_ARGS, for at most N seconds; 0 in a stage's seconds skips it.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
TESTS=${1:-150}; BENCH=${2:-300}; shift 2 2>/dev/null || shift $#
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || { echo "offline install of .whl failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
  nproc; free -g | head -2; df -h /tmp | tail -1; } 2>&1 | tee "$OUT/machine.txt"
if [ "$TESTS" != 0 ]; then
  timeout "$TESTS" python3 -m pytest -q -p no:cacheprovider --timeout 120 -rA -s tests/test_cuda.py ${CUDA_TESTS:+-k "$CUDA_TESTS"} 2>&1 \
    | grep -v "^PASSED\|^$\|^DEBUG" | tee "$OUT/tests.log" | tail -60
fi
RANKS=${RANKS_SECONDS:-180}
if [ "$TESTS" != 0 ] && [ "$RANKS" != 0 ]; then
  timeout "$RANKS" python3 -m pytest -q -p no:cacheprovider --timeout "$RANKS" -rA tests/test_cuda_ranks.py ${CUDA_TESTS:+-k "$CUDA_TESTS"} 2>&1 \
    | grep -v "^PASSED\|^$\|^DEBUG" | tee "$OUT/ranks.log" | tail -40
fi
if [ "$BENCH" != 0 ]; then
  timeout "$BENCH" python3 benchmarks/gpu.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^DEBUG" | tail -40
fi
if [ "${LLAMA_SECONDS:-0}" != 0 ]; then
  # shellcheck disable=SC2086  # LLAMA_ARGS is a list of arguments
  timeout "$LLAMA_SECONDS" python3 benchmarks/gpu.py --model llama --out "$OUT" --probe-seconds 0 ${LLAMA_ARGS:-} \
    2>&1 | tee -a "$OUT/llama.log" | grep -v "^DEBUG" | tail -30
fi
if [ "${LARGEST_SECONDS:-0}" != 0 ]; then
  # shellcheck disable=SC2086  # LARGEST_ARGS is a list of arguments
  timeout "$LARGEST_SECONDS" python3 benchmarks/largest.py --run --device cuda --json "$OUT/largest.json" ${LARGEST_ARGS:-} \
    2>&1 | tee "$OUT/largest.log" | grep -v "^DEBUG" | tail -30
fi
