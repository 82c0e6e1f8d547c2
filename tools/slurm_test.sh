#!/usr/bin/env bash
# Testing on a SLURM cluster, as mmdet's / mmseg's tools/slurm_test.sh:
#   [GPUS=8] [GPUS_PER_NODE=8] tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args]
# srun starts GPUS tasks, each runs tools/test.py --launcher slurm (tools/slurm_train.sh says how). A
# sharded FSDP checkpoint folder (state_dict_cfg='local') needs GPUS = the training's world size;
# a checkpoint file (state_dict_cfg='full', the recipes') loads at any.
# Environment: GPUS (default 8), GPUS_PER_NODE (default 8; 0: no --gres), CPUS_PER_TASK (default 5),
# SRUN_ARGS, PYTHON.
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args]" >&2
    exit 2
fi
PARTITION=$1
JOB_NAME=$2
CONFIG=$3
CHECKPOINT=$4
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-""}
PYTHON=${PYTHON:-python}
GRES=()
if [ "$GPUS_PER_NODE" -gt 0 ]; then GRES=(--gres="gpu:$GPUS_PER_NODE"); fi
TASKS_PER_NODE=$GPUS_PER_NODE
if [ "$TASKS_PER_NODE" -eq 0 ] || [ "$TASKS_PER_NODE" -gt "$GPUS" ]; then TASKS_PER_NODE=$GPUS; fi
# shellcheck disable=SC2086
PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
srun -p "$PARTITION" \
    --job-name="$JOB_NAME" \
    "${GRES[@]}" \
    --ntasks="$GPUS" \
    --ntasks-per-node="$TASKS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 \
    $SRUN_ARGS \
    "$PYTHON" -u "$(dirname "$0")/test.py" "$CONFIG" "$CHECKPOINT" --launcher=slurm "${@:5}"
