#!/usr/bin/env bash
# One GPU: the GPU tests of the local kernels, then the block-shape sweep or the benchmark.
#   launch/gpu_local.sh tests tune bench      (any subset, in order)
# TESTS_K (a pytest -k expression), TUNE_ARGS (e.g. "--head-dims 128"), TESTS_TIMEOUT and
# TUNE_TIMEOUT (seconds) narrow a step. Registers, spills, shared memory and wgmma waits of the
# kernels need no GPU: benchmarks/kernel_report.py.
# Logs and JSON go to $OUT (default .device_out/). TRITON_CACHE_DIR is kept in the checkout
# so compiled kernels can be carried to the next call.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
status=0
for step in "$@"; do
  case $step in
    tests) timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -m gpu tests/ -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 || status=1 ;;
    tune)  timeout ${TUNE_TIMEOUT:-540} python3 benchmarks/bench_local.py --tune ${TUNE_ARGS:-} --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | grep -E "BEST|error" || status=1 ;;
    bench) timeout 500 python3 benchmarks/bench_local.py --json "$OUT/local.json" 2>&1 | tee "$OUT/bench.log" | tail -30 || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
