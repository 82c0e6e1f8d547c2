#!/usr/bin/env bash
# Distributed testing: tools/dist_test.sh CONFIG CHECKPOINT NPROC [test.py args]
# NPROC processes on this machine; on several machines run it on each with NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (or PORT) set (tools/dist_run.sh; docs/large-models.md). PYTHON: the
# interpreter. A sharded FSDP checkpoint (a folder of rankN.pth) needs the training's world size.
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 CONFIG CHECKPOINT NPROC [test.py args]" >&2
    exit 2
fi
exec bash "$(dirname "$0")/dist_run.sh" "$(dirname "$0")/test.py" "$3" "$1" "$2" "${@:4}"
