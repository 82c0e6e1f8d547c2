#!/usr/bin/env python
"""Multi-scale Swin features of images, from a folder to a whole dataset (also under torchrun).

A thin wrapper over :mod:`swin_backbone.tools.extract_features` (installed as
``swin-extract-features``); see ``--help`` there for every flag.

    python tools/extract_features.py INPUT OUT_DIR --arch tiny --checkpoint swin_t.pth
    torchrun --nproc-per-node 4 tools/extract_features.py INPUT OUT_DIR --checkpoint swin_t.pth --pool avg
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone.tools.extract_features import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
