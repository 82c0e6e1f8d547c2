#!/usr/bin/env bash
# Distributed training: tools/dist_train.sh CONFIG NPROC [train.py args]
# NPROC processes on this machine; on several machines run it on each with NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (or PORT) set (tools/dist_run.sh; docs/large-models.md). PYTHON: the
# interpreter.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG NPROC [train.py args]" >&2
    exit 2
fi
exec bash "$(dirname "$0")/dist_run.sh" "$(dirname "$0")/train.py" "$2" "$1" "${@:3}"
