#!/usr/bin/env bash
# One GPU: the GPU tests, the block-shape sweep, the local benchmark, packed documents (one GPU
# and the packed ring replayed) and the host time per call, in the order given.
#   launch/gpu_local.sh tests tune bench packed replay host      (any subset, in order)
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
    packed) limit python3 -m benchmarks.packed --json "$OUT/packed.json" 2>&1 \
             | tee "$OUT/packed.log" | tail -22 || status=1 ;;
    replay) limit python3 -m benchmarks.packed_ring_replay --totals 131072 --worlds 4 8 --no-inline \
               --documents-backward default two-pass --json "$OUT/packed_ring_replay.json" 2>&1 \
             | tee "$OUT/packed_ring_replay.log" | grep "S=" || status=1 ;;
    host)  limit python3 -m benchmarks.profile_host --sections launch local packed ring --ring-world 8 --calls 50 \
               --split 2>&1 | tee "$OUT/profile_host.log" | grep -E "per call" || status=1 ;;
    *) echo "unknown step $step (steps: tests tune bench packed replay host)"; status=2 ;;
  esac
done
exit $status
