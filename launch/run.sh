#!/usr/bin/env bash
# Start a ringflash script on several processes of this machine with torchrun.
#
#   launch/run.sh SCRIPT.py [ARGS...]
#
# Environment (all optional):
#   RINGFLASH_NPROC        processes (default: the number of GPUs, or 2 without GPUs)
#   RINGFLASH_DIST_BACKEND nccl or gloo (default: nccl with GPUs, gloo without)
#   RINGFLASH_LOG_RANKS    ranks whose output is shown, e.g. 0 or 0,1 (default 0; all ranks' logs
#                          are kept under RINGFLASH_LOG_DIR, default .logs/)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  sed -n '2,12p' "$0"; exit 2
fi
PY=${PYTHON:-python3}
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${RINGFLASH_DIST_BACKEND:-}" = "gloo" ]; then NGPU=0; fi
export RINGFLASH_DIST_BACKEND=${RINGFLASH_DIST_BACKEND:-$([ "$NGPU" -gt 0 ] && echo nccl || echo gloo)}
NPROC=${RINGFLASH_NPROC:-$([ "$NGPU" -gt 0 ] && echo "$NGPU" || echo 2)}
if [ "$RINGFLASH_DIST_BACKEND" = "nccl" ] && [ "$NPROC" -gt "$NGPU" ]; then
  echo "launch/run.sh: NCCL needs one GPU per process: $NPROC processes, $NGPU GPUs" >&2; exit 2
fi
# torch's CPU threads: share the cores between the processes
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ( $(nproc) + NPROC - 1 ) / NPROC ))}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LOG_DIR=${RINGFLASH_LOG_DIR:-.logs}
mkdir -p "$LOG_DIR"
exec $PY -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
  --log-dir "$LOG_DIR" --tee 3 --local-ranks-filter "${RINGFLASH_LOG_RANKS:-0}" "$@"
