#!/usr/bin/env python
"""Shape buckets for an mmdet config: its batch shapes, padding and captures, and a bucket set.

A thin wrapper over :mod:`swin_backbone.tools.buckets` (installed as ``swin-buckets``); see
``--help`` there for every flag (docs/shape-buckets.md).

    python tools/buckets.py configs/mmdet/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py --pick 4 --bound 1344x1344
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone.tools.buckets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
