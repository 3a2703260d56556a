#!/usr/bin/env bash
# Start a ringflash script on several processes of this machine with torchrun, from a checkout:
#   launch/run.sh SCRIPT.py [ARGS...]        (or -m PACKAGE.MODULE [ARGS...])
# The same as the installed `ringflash-run` (python -m ringflash.launch --help for its options;
# RINGFLASH_NPROC, RINGFLASH_DIST_BACKEND, RINGFLASH_LOG_RANKS and RINGFLASH_LOG_DIR set them).
# It runs from the current directory; only when ringflash is not installed does it put this
# checkout on PYTHONPATH (at the end, so it never shadows an installed one).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
if ! $PY -c "import ringflash" 2>/dev/null; then
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$REPO
fi
exec $PY -m ringflash.launch "$@"
