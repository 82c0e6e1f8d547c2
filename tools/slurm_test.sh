#!/usr/bin/env bash
# Testing on a SLURM cluster, as mmdet's / mmseg's tools/slurm_test.sh:
#   [GPUS=8] [GPUS_PER_NODE=8] tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args]
# srun starts GPUS tasks, each running tools/test.py --launcher=slurm (tools/slurm_run.sh: the
# environment variables it reads). A sharded FSDP checkpoint folder (state_dict_cfg='local') needs
# GPUS = the training's world size; a checkpoint file (state_dict_cfg='full', the recipes') loads at any.
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG CHECKPOINT [test.py args]" >&2
    exit 2
fi
exec "$(dirname "$0")/slurm_run.sh" "$1" "$2" test.py "$3" "$4" --launcher=slurm "${@:5}"
