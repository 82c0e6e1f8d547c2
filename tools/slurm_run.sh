#!/usr/bin/env bash
# What tools/slurm_train.sh and tools/slurm_test.sh share (as dist_run.sh for the torchrun scripts):
#   tools/slurm_run.sh PARTITION JOB_NAME SCRIPT [script args]
# srun starts GPUS tasks, GPUS_PER_NODE per node, each running tools/SCRIPT with the arguments given
# (the callers pass --launcher=slurm: each task takes its rank, world size and master address from
# the variables SLURM sets, mmengine's slurm launcher; the first node of the job is the master,
# MASTER_PORT default 29500).
# Environment: GPUS (default 8), GPUS_PER_NODE (default 8; 0: no --gres, CPU jobs), CPUS_PER_TASK
# (default 5), SRUN_ARGS (more srun options), PYTHON (the interpreter, default python).
set -euo pipefail
PARTITION=$1
JOB_NAME=$2
SCRIPT=$3
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-""}
PYTHON=${PYTHON:-python}
GRES=()
if [ "$GPUS_PER_NODE" -gt 0 ]; then GRES=(--gres="gpu:$GPUS_PER_NODE"); fi
TASKS_PER_NODE=$GPUS_PER_NODE
if [ "$TASKS_PER_NODE" -eq 0 ] || [ "$TASKS_PER_NODE" -gt "$GPUS" ]; then TASKS_PER_NODE=$GPUS; fi
# shellcheck disable=SC2086  # SRUN_ARGS: several options
PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" \
srun -p "$PARTITION" \
    --job-name="$JOB_NAME" \
    "${GRES[@]}" \
    --ntasks="$GPUS" \
    --ntasks-per-node="$TASKS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 \
    $SRUN_ARGS \
    "$PYTHON" -u "$(dirname "$0")/$SCRIPT" "${@:4}"
