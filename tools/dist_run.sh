#!/usr/bin/env bash
# Shared torchrun launcher of dist_train.sh / dist_test.sh:
#   tools/dist_run.sh SCRIPT NPROC [script args]
# mmengine's pytorch launcher; nccl on GPUs, gloo on CPU (tools set that up).
set -euo pipefail
SCRIPT=$1
NPROC=$2
PYTHON=${PYTHON:-python}
PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
"$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" \
    --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --nproc_per_node="$NPROC" \
    --master_port="${PORT:-29500}" \
    "$SCRIPT" "${@:3}" --launcher pytorch
