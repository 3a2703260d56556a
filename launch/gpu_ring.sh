#!/usr/bin/env bash
# Several GPUs of one node: the ring over NCCL (issues 7 and 8), in one device call.
#   launch/gpu_ring.sh tests bench maxlen train scaling      (any subset, in order)
# tests: the GPU ring tests (NCCL ring vs one GPU, chunked dK/dV exchange, bitwise determinism,
#        replayed schedules); bench: benchmarks/bench_ring.py for MHA and GQA 32/8 beside
#        PyTorch's context_parallel; maxlen: the longest causal sequence whose forward+backward
#        fits (MHA and GQA 32/8), with peak memory per GPU; train: the long-context example at 128K tokens, bf16,
#        with --check against a one-process run of the same model; scaling: weak (S = P x 32K) and
#        strong (S = 256K) scaling points for this P, MHA and GQA 32/8, beside context_parallel with
#        cuDNN (issue 8; benchmarks/plot_scaling.py turns the files of several P into a plot).
# Logs and JSON go to $OUT (default .device_out/).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-.device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $NGPU"; nvidia-smi topo -m 2>/dev/null | head -n $((NGPU + 1))
if [ "$NGPU" -lt 2 ]; then echo "launch/gpu_ring.sh: needs 2 or more GPUs" >&2; exit 2; fi
export RINGFLASH_LOG_DIR=$OUT/logs
status=0
for step in "$@"; do
  case $step in
    tests) timeout 540 python3 -m pytest -m gpu tests/test_gpu_ring.py -q -p no:cacheprovider 2>&1 \
             | tee "$OUT/gpu_ring_tests.log" | tail -5 || status=1 ;;
    bench) timeout 270 launch/run.sh benchmarks/bench_ring.py --json "$OUT/ring_mha.json" 2>&1 \
             | tee "$OUT/bench_ring_mha.log" | tail -12 || status=1
           timeout 270 launch/run.sh benchmarks/bench_ring.py --kv-heads 8 --json "$OUT/ring_gqa.json" 2>&1 \
             | tee "$OUT/bench_ring_gqa.log" | tail -12 || status=1 ;;
    maxlen) timeout 320 launch/run.sh benchmarks/bench_ring_maxlen.py --json "$OUT/maxlen_mha.json" 2>&1 \
             | tee "$OUT/maxlen_mha.log" | tail -8 || status=1
            timeout 300 launch/run.sh benchmarks/bench_ring_maxlen.py --kv-heads 8 --json "$OUT/maxlen_gqa.json" 2>&1 \
             | tee "$OUT/maxlen_gqa.log" | tail -8 || status=1 ;;
    train) timeout 500 launch/run.sh examples/train_long_context.py --seq-len 131072 --dtype bfloat16 \
             --dim 512 --layers 4 --heads 8 --kv-heads 2 --steps 30 --check 2>&1 \
             | tee "$OUT/train_128k.log" | tail -12 || status=1 ;;
    scaling) for kv in 32 8; do
               timeout 280 launch/run.sh benchmarks/bench_ring.py --seqlens $((NGPU * 32768)) 262144 --kv-heads $kv \
                 --peers cudnn --json "$OUT/scaling_p${NGPU}_kv${kv}.json" 2>&1 \
                 | tee "$OUT/scaling_p${NGPU}_kv${kv}.log" | tail -10 || status=1
             done ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
