#!/usr/bin/env python
"""Evaluate a checkpoint with the config's metrics (mmdet or mmseg config, as mmdet's tools/test.py).

A thin wrapper: ``python tools/test.py`` = ``python -m swin_backbone.tools.test`` (installed as
``swin-test``); see ``--help`` there for every flag.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone.tools.test import cli  # noqa: E402

if __name__ == "__main__":
    cli()
