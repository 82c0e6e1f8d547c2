#!/usr/bin/env bash
# Distributed training: tools/dist_train.sh CONFIG NPROC [train.py args]
# Env: NNODES, NODE_RANK, MASTER_ADDR, PORT, PYTHON.
set -euo pipefail
exec bash "$(dirname "$0")/dist_run.sh" "$(dirname "$0")/train.py" "$2" "$1" "${@:3}"
