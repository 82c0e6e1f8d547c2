#!/usr/bin/env python
"""Thin wrapper: ``python tools/analysis_tools/benchmark.py`` = ``python -m swin_backbone.tools.benchmark``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from swin_backbone.tools.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
