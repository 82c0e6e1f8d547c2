#!/usr/bin/env python
"""Convert a Swin checkpoint of any supported format to ours, mmdet's or the official layout.

    python tools/convert_checkpoint.py SRC DST [--to ours|mmdet|official] [--arch tiny]

The source format is detected (official classification / detection, mmdet / mmseg /
mmpretrain, timm, torchvision, ours; wrapped in state_dict / model / module. / backbone.).
The weights are loaded into a SwinBackbone of the matching architecture (inferred from the
tensors, or given with --arch / --window-size), which resizes what needs resizing, and the
per-key report is printed. The output holds ``{'state_dict': ..., 'meta': ...}``.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone.checkpoint.convert import convert_file  # noqa: E402
from swin_backbone.checkpoint.formats import FROM_OURS  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="source checkpoint (.pth)")
    parser.add_argument("dst", help="output file")
    parser.add_argument("--to", choices=sorted(FROM_OURS), default="ours", help="output key layout (default: ours)")
    parser.add_argument("--arch", help="tiny/small/base/large (default: inferred from the weights)")
    parser.add_argument("--window-size", type=int, help="target window (default: the checkpoint's)")
    parser.add_argument("--strict", action="store_true", help="fail unless every tensor maps")
    args = parser.parse_args(argv)
    report = convert_file(args.src, args.dst, to=args.to, arch=args.arch, window_size=args.window_size, strict=args.strict)
    print(report.summary())
    print(f"wrote {args.dst} ({args.to} layout)")


if __name__ == "__main__":
    main()
