#!/usr/bin/env python
"""Train a detector / segmentor with mmengine's Runner (mmdet or mmseg config, as mmdet's tools/train.py).

A thin wrapper: ``python tools/train.py`` = ``python -m swin_backbone.tools.train`` (installed as
``swin-train``); see ``--help`` there for every flag.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone.tools.train import cli  # noqa: E402

if __name__ == "__main__":
    cli()
