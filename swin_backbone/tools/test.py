"""Evaluate a checkpoint with the config's metrics (COCO mAP via pycocotools, mIoU via
mmseg's IoUMetric); mmdet or mmseg config, scope from its ``default_scope``.

FlexibleRunner configs (the FSDP recipes) run as they trained: distributed, a checkpoint file at
any world size, a sharded folder at the world size that saved it; one process (no launcher) with a
file runs the same model under mmengine's Runner."""
from __future__ import annotations

import argparse
import os

from ..mmlab.runner import CheckpointMismatchError, config_scope
from . import runner as R
from .job import leave_job


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Test (and evaluate) a detector / segmentor with a Swin backbone")
    parser.add_argument("config", help="test config file path")
    parser.add_argument("checkpoint", help="checkpoint file, or a URL / torchvision:// / open-mmlab:// reference "
                        "as in mmengine (downloaded once into torch's hub cache), or a sharded FSDP checkpoint folder "
                        "(rankN.pth; at the world size that saved it)")
    parser.add_argument("--work-dir", help="the dir to save the evaluation metrics")
    parser.add_argument("--out", help="dump predictions to a pickle file (mmdet) / a directory (mmseg)")
    parser.add_argument("--show", action="store_true", help="show predictions in a window")
    parser.add_argument("--show-dir", help="save painted predictions here (under work_dir/timestamp)")
    parser.add_argument("--wait-time", type=float, default=2, help="the interval of --show (s)")
    return R.parse_tool_args(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    from ..checkpoint.remote import fetch, is_reference, resolve  # (the backbones and mmengine's models: not for --help)

    with R.tool_setup(args, R.program("test.py")) as cfg:  # bad arguments or config: one line, exit status 1
        if is_reference(args.checkpoint):  # a URL (or torchvision:// ...): fetched once into torch's hub cache
            if resolve(args.checkpoint)[0] != "mmengine":  # (storage backends: mmengine's loader reads them)
                args.checkpoint = fetch(args.checkpoint)[0]
        elif os.path.isdir(args.checkpoint):  # a sharded FSDP checkpoint (state_dict_cfg='local')
            R.check_shard_folder(cfg, args.checkpoint)
        elif not os.path.isfile(args.checkpoint):
            raise FileNotFoundError(f"checkpoint {args.checkpoint!r}: no such file")
        R.single_process_runner(cfg, args.checkpoint)
        scope = config_scope(cfg)
        if args.out and scope == "mmdet" and not args.out.endswith((".pkl", ".pickle")):
            raise ValueError(f"--out: expected a .pkl file, got {args.out!r}")
        if args.out and scope == "mmseg" and os.path.isfile(args.out):
            raise NotADirectoryError(f"--out: {args.out!r} is a file; expected a folder for mmseg predictions")
    cfg.load_from = args.checkpoint
    R.setup_cpu_distributed(cfg)
    if args.show or args.show_dir:
        R.trigger_visualization(cfg, args.show, args.show_dir, args.wait_time)
    if args.out and scope == "mmseg":
        cfg.test_evaluator["output_dir"] = args.out
        cfg.test_evaluator["keep_results"] = True
    runner = R.build_runner(cfg)
    R.rank_zero_test_json(runner)
    # README: a checkpoint matching under half the model is an error, not random weights evaluated.
    R.require_checkpoint_match_any(runner, args.checkpoint)
    if args.out and scope == "mmdet":
        from mmdet.evaluation import DumpDetResults

        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))
    try:
        metrics = runner.test()
    except CheckpointMismatchError as err:
        raise SystemExit(f"{R.program('test.py')}: error: {err}") from err
    return metrics


def cli() -> None:
    """The command (``swin-test``, ``python -m swin_backbone.tools.test``, tools/test.py)."""
    main()
    leave_job(0)  # a torchrun rank ends without the process group's teardown


if __name__ == "__main__":
    cli()
