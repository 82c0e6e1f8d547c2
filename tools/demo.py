#!/usr/bin/env python
"""End-to-end demo on generated data (what `make demo` runs):

1. write a toy dataset in the real COCO layout (tools/make_toy_data.py);
2. train Mask R-CNN + FPN with a small SwinBackbone on it from scratch, on the CPU
   (tools/train.py, mmengine Runner);
3. evaluate the final checkpoint with COCO bbox / segm mAP (tools/test.py, pycocotools).

    python tools/demo.py [--seg] [--iters N] [--work-dir DIR]

``--seg`` runs the segmentation demo instead (UPerNet on toy ADE20K, mIoU).
Every step is a separate command, printed before it runs, so it can be repeated by hand.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from swin_backbone.tools.runner import read_metrics  # noqa: E402

DET_CONFIG = "configs/toy/mask-rcnn_swin-toy_fpn_toy-coco.py"
SEG_CONFIG = "configs/toy/upernet_swin-toy_toy-ade.py"


def run(cmd, env=None):
    print("\n$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seg", action="store_true", help="segmentation demo (UPerNet, toy ADE20K, mIoU)")
    parser.add_argument("--iters", type=int, help="training iterations (default: the config's)")
    parser.add_argument("--data-root", default=os.environ.get("TOY_DATA_ROOT", "data"))
    parser.add_argument("--work-dir", help="default: work_dirs/demo_det or work_dirs/demo_seg")
    args = parser.parse_args(argv)

    py = sys.executable
    env = dict(os.environ, TOY_DATA_ROOT=args.data_root)
    config = SEG_CONFIG if args.seg else DET_CONFIG
    work_dir = args.work_dir or os.path.join("work_dirs", "demo_seg" if args.seg else "demo_det")
    which = "ade" if args.seg else "coco"
    marker = os.path.join(ROOT, args.data_root, "toy_ade" if args.seg else "toy_coco")
    start = time.time()
    if not os.path.isdir(marker):
        run([py, "tools/make_toy_data.py", "--out", args.data_root, "--which", which], env)
    else:
        print(f"toy data found in {marker}")
    train = [py, "tools/train.py", config, "--work-dir", work_dir]
    if args.iters:
        train += ["--cfg-options", f"train_cfg.max_iters={args.iters}", f"train_cfg.val_interval={args.iters}",
                  f"default_hooks.checkpoint.interval={args.iters}"]
    run(train, env)
    checkpoint = open(os.path.join(ROOT, work_dir, "last_checkpoint")).read().strip()
    run([py, "tools/test.py", config, checkpoint, "--work-dir", work_dir], env)
    metrics = {}
    for row in read_metrics(os.path.join(ROOT, work_dir)):  # the test run's metrics come last
        metrics.update(row)
    minutes = (time.time() - start) / 60
    print("\n" + "=" * 72)
    if args.seg:
        print(f"UPerNet + SwinBackbone on toy ADE20K: mIoU {metrics.get('mIoU', float('nan')):.2f} "
              f"(aAcc {metrics.get('aAcc', float('nan')):.2f}) after {minutes:.1f} min")
    else:
        print(f"Mask R-CNN + SwinBackbone on toy COCO: bbox mAP {metrics.get('coco/bbox_mAP', float('nan')):.3f}, "
              f"segm mAP {metrics.get('coco/segm_mAP', float('nan')):.3f} after {minutes:.1f} min")
    print(f"checkpoint: {checkpoint}")
    print("=" * 72)
    return 0


if __name__ == "__main__":
    sys.exit(main())
