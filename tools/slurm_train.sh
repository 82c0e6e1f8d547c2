#!/usr/bin/env bash
# Training on a SLURM cluster, as mmdet's / mmseg's tools/slurm_train.sh:
#   [GPUS=16] [GPUS_PER_NODE=8] tools/slurm_train.sh PARTITION JOB_NAME CONFIG WORK_DIR [train.py args]
# srun starts GPUS tasks, GPUS_PER_NODE per node, each running tools/train.py --launcher=slurm
# (tools/slurm_run.sh: the environment variables it reads). WORK_DIR must be on a file system every
# node shares (tools/train.py checks at start-up).
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG WORK_DIR [train.py args]" >&2
    exit 2
fi
exec "$(dirname "$0")/slurm_run.sh" "$1" "$2" train.py "$3" --work-dir="$4" --launcher=slurm "${@:5}"
