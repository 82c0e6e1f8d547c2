"""Train a detector or segmentor (mmdet or mmseg config) with mmengine's Runner.

Same flags and behaviour as mmdet's and mmseg's tools/train.py; the scope is taken from the
config's ``default_scope``.
"""
from __future__ import annotations

import argparse
import os

from . import runner as R
from .job import leave_job


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train a detector / segmentor with a Swin backbone")
    parser.add_argument("config", help="train config file path")
    parser.add_argument("--work-dir", help="the dir to save logs and models")
    parser.add_argument("--amp", action="store_true", help="mixed precision (fp16 on CUDA, bf16 on CPU)")
    parser.add_argument("--auto-scale-lr", action="store_true", help="scale the LR by the total batch size")
    parser.add_argument(
        "--resume",
        nargs="?",
        type=str,
        const="auto",
        help="resume from this checkpoint, or (no value) from the latest one in the work dir",
    )
    return R.parse_tool_args(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    with R.tool_setup(args, R.program("train.py")) as cfg:  # bad arguments or config: one line, exit status 1
        if args.resume not in (None, "auto") and "://" not in args.resume and not os.path.exists(args.resume):
            raise FileNotFoundError(f"--resume: no such checkpoint file or sharded checkpoint folder {args.resume!r} "
                                    "(or give no value: the latest checkpoint in the work dir)")
        if args.resume not in (None, "auto") and os.path.isdir(args.resume):
            R.check_shard_folder(cfg, args.resume)
    if args.amp:
        R.enable_amp(cfg)
    if args.auto_scale_lr:
        if "auto_scale_lr" not in cfg or "base_batch_size" not in cfg.auto_scale_lr:
            raise SystemExit("--auto-scale-lr: the config has no auto_scale_lr.base_batch_size")
        cfg.auto_scale_lr.enable = True
    R.resume_settings(cfg, args.resume)
    R.setup_cpu_distributed(cfg)
    checked = R.check_shared_work_dir(cfg.work_dir)  # where the process group exists already (CPU)
    runner = R.build_runner(cfg)
    if not checked:  # on GPUs the Runner starts it (mmengine's launchers)
        R.check_shared_work_dir(runner.work_dir)
    runner.train()


def cli() -> None:
    """The command (``swin-train``, ``python -m swin_backbone.tools.train``, tools/train.py)."""
    main()
    leave_job(0)  # a torchrun rank ends without the process group's teardown


if __name__ == "__main__":
    cli()
