#!/usr/bin/env bash
# Several GPUs of one machine: the ring over NCCL, in order.
#   launch/gpu_ring.sh tests bench maxlen train scaling packed      (any subset, in order)
# tests:   the GPU ring tests (NCCL ring against one GPU, chunked dK/dV exchange, bitwise
#          determinism, replayed schedules)
# bench:   benchmarks.bench_ring for MHA and GQA 32/8 beside PyTorch's context_parallel
# maxlen:  the longest causal sequence whose forward+backward fits (MHA and GQA 32/8), with
#          peak memory per GPU
# train:   the long-context example at 128K tokens, bf16, with --check against one process
# packed:  packed documents over NCCL (benchmarks.bench_packed_ring): the balanced layout, every
#          document cut over every rank, and the two-rank cut, at 128K and 512K tokens;
#          PACKED_ARGS adds options, e.g. PACKED_ARGS="--forward-group-steps 1 4" (variants of a
#          ringflash.balance constant, timed over NCCL)
# scaling: weak (S = P x 32K) and strong (S = 256K) scaling points for this P, MHA and GQA 32/8,
#          beside context_parallel with cuDNN (python -m benchmarks.plot_scaling turns the files
#          of several P into a table and a plot)
# STEP_TIMEOUT (seconds, default none) stops a command that runs longer. Logs and JSON go to
# $OUT (default .device_out/).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-.device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
limit() { if [ "${STEP_TIMEOUT:-0}" -gt 0 ]; then timeout "$STEP_TIMEOUT" "$@"; else "$@"; fi; }
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU"; nvidia-smi topo -m 2>/dev/null | head -n $((NGPU + 1))
if [ "$NGPU" -lt 2 ]; then echo "launch/gpu_ring.sh: needs 2 or more GPUs" >&2; exit 2; fi
export RINGFLASH_LOG_DIR=$OUT/logs
RUN="launch/run.sh"
status=0
for step in "$@"; do
  case $step in
    tests) limit python3 -m pytest -m gpu tests/test_gpu_ring.py -q -p no:cacheprovider 2>&1 \
             | tee "$OUT/gpu_ring_tests.log" | tail -5 || status=1 ;;
    bench) limit $RUN -m benchmarks.bench_ring --json "$OUT/ring_mha.json" 2>&1 \
             | tee "$OUT/bench_ring_mha.log" | tail -12 || status=1
           limit $RUN -m benchmarks.bench_ring --kv-heads 8 --json "$OUT/ring_gqa.json" 2>&1 \
             | tee "$OUT/bench_ring_gqa.log" | tail -12 || status=1 ;;
    maxlen) limit $RUN -m benchmarks.bench_ring_maxlen --json "$OUT/maxlen_mha.json" 2>&1 \
             | tee "$OUT/maxlen_mha.log" | tail -8 || status=1
            limit $RUN -m benchmarks.bench_ring_maxlen --kv-heads 8 --json "$OUT/maxlen_gqa.json" 2>&1 \
             | tee "$OUT/maxlen_gqa.log" | tail -8 || status=1 ;;
    train) limit $RUN examples/train_long_context.py --seq-len 131072 --dtype bfloat16 \
             --dim 512 --layers 4 --heads 8 --kv-heads 2 --steps 30 --check 2>&1 \
             | tee "$OUT/train_128k.log" | tail -12 || status=1 ;;
    scaling) for kv in 32 8; do
               limit $RUN -m benchmarks.bench_ring --seqlens $((NGPU * 32768)) 262144 --kv-heads $kv \
                 --peers cudnn --json "$OUT/scaling_p${NGPU}_kv${kv}.json" 2>&1 \
                 | tee "$OUT/scaling_p${NGPU}_kv${kv}.log" | tail -10 || status=1
             done ;;
    packed) limit $RUN -m benchmarks.bench_packed_ring --totals 131072 524288 \
             --layouts balanced document-zigzag two-ranks ${PACKED_ARGS:-} --json "$OUT/packed_ring.json" 2>&1 \
             | tee "$OUT/packed_ring.log" | tail -10 || status=1 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
