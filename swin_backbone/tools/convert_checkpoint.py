"""Convert a Swin checkpoint of any supported format to ours, mmdet's, the official or the
Hugging Face transformers layout (Swin V2: ours, official, timm, torchvision, mmpretrain, hf).

    swin-convert-checkpoint SRC DST [--to ours|mmdet|official|hf] [--arch tiny]
    python -m swin_backbone.tools.convert_checkpoint SRC DST ...

The source format is detected (official classification / detection, mmdet / mmseg / mmcls /
mmpretrain, timm, torchvision, transformers, ours; wrapped in state_dict / model / module. /
backbone.; .pth, .bin or .safetensors). The weights are loaded into a SwinBackbone of the
matching architecture (inferred from the tensors, or given with --arch / --window-size), which
resizes what needs resizing, and the per-key report is printed. A DST ending in .safetensors
is written as safetensors, any other as ``{'state_dict': ..., 'meta': ...}`` with torch.save;
through a temporary file, so a failure leaves no partial output.

Exit status: 0 converted, 1 the conversion failed (one line on stderr says why), 2 usage error.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..checkpoint.convert import convert_file, describe_arch
from ..checkpoint.formats import FROM_OURS, CheckpointError
from ..checkpoint.formats_v2 import V2_FROM_OURS


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swin-convert-checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="source checkpoint (.pth / .bin / .safetensors)")
    parser.add_argument("dst", help="output file (.safetensors: safetensors; anything else: torch.save)")
    parser.add_argument("--to", choices=sorted(set(FROM_OURS) | set(V2_FROM_OURS)), default="ours",
                        help="output key layout (default: ours); Swin V1: ours, mmdet, official, hf; "
                             "Swin V2: ours, official, timm, torchvision, mmpretrain, hf")
    parser.add_argument("--arch", help="tiny/small/base/large (default: inferred from the weights)")
    parser.add_argument("--window-size", type=int, help="target window (default: the checkpoint's)")
    parser.add_argument("--strict", action="store_true", help="fail unless every tensor maps")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the conversion; 0 on success, 1 (one line on stderr) on failure; argparse exits 2."""
    args = parse_args(argv)
    try:
        report, meta = convert_file(args.src, args.dst, to=args.to, arch=args.arch, window_size=args.window_size,
                                    strict=args.strict)
    except (CheckpointError, ValueError, OSError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"swin-convert-checkpoint: error: {reason}", file=sys.stderr)
        return 1
    print(report.summary())
    print(f"architecture: {describe_arch(meta['arch'])}")  # type: ignore[arg-type]
    container = "safetensors" if args.dst.lower().endswith(".safetensors") else "torch.save"
    print(f"wrote {args.dst} ({args.to} layout, {meta['written']} tensors, {container})")
    if meta["not_loaded"]:
        print(f"not written: {meta['not_loaded']} model tensors the checkpoint does not provide (listed under missing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
