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

The conversion itself is :func:`convert_file` (with
:func:`~swin_backbone.checkpoint.detect.infer_arch`), usable without the command line.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

# Only what the command line needs up front (the formats, for --to's choices): the model and
# the loading path (mmengine) load when a conversion runs, so --help stays quick.
from ..checkpoint.base import FROM_OURS, V2_FROM_OURS, CheckpointError
from ..checkpoint.detect import infer_arch  # (imports every format module: FROM_OURS is complete)

if TYPE_CHECKING:
    from ..checkpoint.loading import LoadReport


def check_paths(src: str, dst: str) -> None:
    """Refuse an output path that cannot be written before anything is read."""
    if os.path.isdir(dst):
        raise CheckpointError(
            f"dst {dst!r}: is a directory; expected an output file path (e.g. {os.path.join(dst, 'converted.pth')!r})"
        )
    if os.path.exists(src) and os.path.exists(dst) and os.path.samefile(src, dst):
        raise CheckpointError(f"dst {dst!r}: is the source file; write the converted checkpoint to another path")


def stored_bytes(checkpoint: object) -> int:
    """Bytes of the distinct storages of the tensors in ``checkpoint`` (its dicts, lists and tuples)."""
    import torch

    seen, total, stack = set(), 0, [checkpoint]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            storage = node.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def convert_file(
    src: str,
    dst: str,
    to: str = "ours",
    arch: Optional[str] = None,
    window_size: Optional[int] = None,
    strict: bool = False,
) -> Tuple[LoadReport, Dict[str, object]]:
    """Read ``src`` (any format), load it into a matching SwinBackbone, save ``dst`` as ``to``.

    ``dst`` ending in ``.safetensors`` is written as safetensors, any other name with
    ``torch.save`` (``{'state_dict': ..., 'meta': ...}``); atomically either way. Only the
    tensors the checkpoint provided are written (a partial checkpoint gives a partial file,
    never randomly initialised tensors).

    Returns:
        ``(report, meta)``: the per-key :class:`LoadReport` and what was written
        (``meta['written']``: tensor count; ``meta['arch']``: the model's arguments).
    Raises:
        CheckpointError: unreadable / non-Swin source, missing keys the architecture is read
            from, a directory or the source as ``dst``, too few tensors matching (or any
            incomplete load with ``strict``).
        ValueError: ``to`` is not a layout of the checkpoint's Swin version.
    """
    import torch

    from ..checkpoint.files import write_checkpoint
    from ..checkpoint.loading import load_checkpoint, read_checkpoint
    from ..model.backbone import SwinBackbone
    from ..model.v2 import SwinV2Backbone

    check_paths(src, dst)
    checkpoint = read_checkpoint(src)
    kwargs = infer_arch(checkpoint, source=src)
    v2 = kwargs.pop("swin_version", 1) == 2
    targets = V2_FROM_OURS if v2 else FROM_OURS
    if to not in targets:
        raise ValueError(
            f"to: expected one of {sorted(targets)} for a Swin V{2 if v2 else 1} checkpoint, got {to!r}"
        )
    if arch is not None:
        for key in ("embed_dims", "depths", "num_heads"):
            kwargs.pop(key)
        kwargs["arch"] = arch
    if window_size is not None:
        kwargs["window_size"] = window_size
    cls = SwinV2Backbone if v2 else SwinBackbone
    with torch.device("meta"):  # (sized before it is allocated: the file's keys and shapes name the model)
        numel = sum(p.numel() for p in cls(**kwargs, drop_path_rate=0.0).parameters())
    held = stored_bytes(checkpoint)
    if numel * 4 > 16 * held + 2**28:
        raise CheckpointError(f"checkpoint {src}: its keys and shapes describe a model of {numel} parameters "
                              f"({numel * 4 / 2**30:.1f} GiB in fp32), far more than its {held} bytes of tensors hold")
    model = cls(**kwargs, drop_path_rate=0.0)
    report = load_checkpoint(model, checkpoint, strict=strict, logger=None)
    report.source = src
    loaded = set(report.loaded)
    state = targets[to]({k: v for k, v in model.state_dict().items() if k in loaded})
    meta: Dict[str, object] = dict(
        swin_backbone_format=to, source=os.path.basename(src), source_format=report.format, arch=kwargs,
        written=len(state), not_loaded=len(report.missing),
    )
    write_checkpoint(dst, state, {k: v for k, v in meta.items() if k not in ("written", "not_loaded")})
    return report, meta


def describe_arch(kwargs: Mapping[str, object]) -> str:
    """``embed_dims=96 depths=(2, 2, 6, 2) ...``: the architecture on one line."""
    keys: List[str] = ["arch", "embed_dims", "depths", "num_heads", "window_size", "patch_size", "in_channels",
                       "out_indices"]
    return " ".join(f"{k}={kwargs[k]}" for k in keys if kwargs.get(k) is not None)


# ---------------------------------------------------------------- command line


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
