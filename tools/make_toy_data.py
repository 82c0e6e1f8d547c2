#!/usr/bin/env python
"""Write the toy COCO / ADE20K datasets the toy configs train on.

A thin wrapper: ``python tools/make_toy_data.py`` = ``python -m swin_backbone.tools.make_toy_data``
(installed as ``swin-make-toy-data``).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone.tools.make_toy_data import main  # noqa: E402

if __name__ == "__main__":
    main()
