#!/usr/bin/env bash
# Distributed testing: tools/dist_test.sh CONFIG CHECKPOINT NPROC [test.py args]
# Env: NNODES, NODE_RANK, MASTER_ADDR, PORT, PYTHON.
set -euo pipefail
exec bash "$(dirname "$0")/dist_run.sh" "$(dirname "$0")/test.py" "$3" "$1" "$2" "${@:4}"
