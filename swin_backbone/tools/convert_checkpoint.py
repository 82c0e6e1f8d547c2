"""Convert a Swin checkpoint of any supported format to ours, mmdet's or the official layout
(Swin V2: to ours, official, timm, torchvision or mmpretrain).

    swin-convert-checkpoint SRC DST [--to ours|mmdet|official] [--arch tiny]
    python -m swin_backbone.tools.convert_checkpoint SRC DST ...

The source format is detected (official classification / detection, mmdet / mmseg /
mmpretrain, timm, torchvision, ours; wrapped in state_dict / model / module. / backbone.).
The weights are loaded into a SwinBackbone of the matching architecture (inferred from the
tensors, or given with --arch / --window-size), which resizes what needs resizing, and the
per-key report is printed. The output holds ``{'state_dict': ..., 'meta': ...}``.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from ..checkpoint.convert import convert_file
from ..checkpoint.formats import FROM_OURS
from ..checkpoint.formats_v2 import V2_FROM_OURS


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swin-convert-checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="source checkpoint (.pth)")
    parser.add_argument("dst", help="output file")
    parser.add_argument("--to", choices=sorted(set(FROM_OURS) | set(V2_FROM_OURS)), default="ours",
                        help="output key layout (default: ours); Swin V2: ours, official, timm, torchvision, mmpretrain")
    parser.add_argument("--arch", help="tiny/small/base/large (default: inferred from the weights)")
    parser.add_argument("--window-size", type=int, help="target window (default: the checkpoint's)")
    parser.add_argument("--strict", action="store_true", help="fail unless every tensor maps")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    report = convert_file(args.src, args.dst, to=args.to, arch=args.arch, window_size=args.window_size, strict=args.strict)
    print(report.summary())
    print(f"wrote {args.dst} ({args.to} layout)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
