#!/usr/bin/env bash
# One GPU: the GPU tests, the block-shape sweep and the local benchmark, in order.
#   launch/gpu_local.sh tests tune bench      (any subset, in order)
# TESTS_K (a pytest -k expression) and TUNE_ARGS (e.g. "--head-dims 128") narrow a step;
# STEP_TIMEOUT (seconds, default none) stops a step that runs longer. Logs and JSON go to $OUT
# (default .device_out/). Registers, spills, shared memory and wgmma waits of the kernels need
# no GPU: python -m benchmarks.kernel_report.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
limit() { if [ "${STEP_TIMEOUT:-0}" -gt 0 ]; then timeout "$STEP_TIMEOUT" "$@"; else "$@"; fi; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
status=0
for step in "$@"; do
  case $step in
    tests) limit python3 -m pytest -m gpu tests/ -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -15 || status=1 ;;
    tune)  limit python3 -m benchmarks.bench_local --tune ${TUNE_ARGS:-} --json "$OUT/tune.json" 2>&1 \
             | tee "$OUT/tune.log" | grep -E "BEST|error" || status=1 ;;
    bench) limit python3 -m benchmarks.bench_local --json "$OUT/local.json" 2>&1 \
             | tee "$OUT/bench.log" | tail -30 || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
