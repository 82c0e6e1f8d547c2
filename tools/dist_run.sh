#!/usr/bin/env bash
# Shared torchrun launcher of dist_train.sh / dist_test.sh:
#   tools/dist_run.sh SCRIPT NPROC [script args]
# mmengine's pytorch launcher; nccl on GPUs, gloo on CPU (tools set that up).
#
# Environment (as mmdet's / mmseg's dist_train.sh), run once per machine:
#   NNODES       machines in the job (default 1)
#   NODE_RANK    this machine's index, 0 .. NNODES-1 (default 0)
#   MASTER_ADDR  address of node 0, reachable from every node (default 127.0.0.1)
#   MASTER_PORT  a free TCP port on node 0 (default 29500; PORT, mmdet's name, is read too)
#   RDZV_BACKEND static (default: NODE_RANK fixes the ranks, as mmdet's scripts) or c10d (torchrun's
#                elastic rendezvous at MASTER_ADDR:MASTER_PORT: nodes may start in any order, and
#                torchrun numbers them itself, so NODE_RANK is not the rank order); RDZV_ID names the
#                job (default swin-backbone), the same on every node
#   PYTHON       the interpreter (default python)
#   SINGLE_HOST_NODES=1  allow NNODES > 1 with a loopback MASTER_ADDR: all "nodes" on this one
#                machine (the tests do that); otherwise that is refused, as is an unset MASTER_ADDR
# Several nodes need one work dir on a shared file system (tools/train.py checks at start-up).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 SCRIPT NPROC [args]" >&2
    exit 2
fi
SCRIPT=$1
NPROC=$2
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [ "$NNODES" -gt 1 ] && [ "${SINGLE_HOST_NODES:-0}" != 1 ]; then
    case "${MASTER_ADDR:-}" in
        "") echo "$0: NNODES=$NNODES but MASTER_ADDR is not set; expected node 0's address, reachable from" \
                 "every node" >&2
            exit 2 ;;
        127.*|localhost|::1|0.0.0.0)
            echo "$0: NNODES=$NNODES but MASTER_ADDR=$MASTER_ADDR is a loopback address, which each node" \
                 "resolves to itself; expected node 0's address, reachable from every node" \
                 "(SINGLE_HOST_NODES=1: all nodes on this machine)" >&2
            exit 2 ;;
    esac
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-${PORT:-29500}}
RDZV_BACKEND=${RDZV_BACKEND:-static}
case "$RDZV_BACKEND" in
    static) RDZV=(--master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT") ;;
    c10d) RDZV=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${RDZV_ID:-swin-backbone}") ;;
    *) echo "$0: RDZV_BACKEND: expected static or c10d, got '$RDZV_BACKEND'" >&2; exit 2 ;;
esac
PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
"$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --nproc_per_node="$NPROC" \
    "${RDZV[@]}" \
    "$SCRIPT" "${@:3}" --launcher pytorch
