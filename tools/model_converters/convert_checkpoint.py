#!/usr/bin/env python
"""Checkout wrapper of ``swin-convert-checkpoint`` (swin_backbone/tools/convert_checkpoint.py).

    python tools/model_converters/convert_checkpoint.py SRC DST [--to ours|mmdet|official] [--arch tiny]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from swin_backbone.tools.convert_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
