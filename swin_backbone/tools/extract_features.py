"""Turn images into multi-scale Swin feature maps, from a folder of ten to a whole dataset.

    swin-extract-features INPUT OUT_DIR --arch tiny --checkpoint swin_t.pth
    swin-extract-features INPUT OUT_DIR --arch v2-tiny --checkpoint swinv2_tiny_patch4_window8_256.pth
    python -m swin_backbone.tools.extract_features 'photos/*.jpg' feats --config configs/mmdet/X.py --checkpoint det.pth
    torchrun --nproc-per-node 8 -m swin_backbone.tools.extract_features coco/train2017 feats --checkpoint swin_t.pth --device cuda --pool avg

``--arch`` names a Swin V1 preset (tiny, small, base, large; window 7), a Swin V2 preset
(v2-tiny ... v2-giant; window 8) or a published Swin V2 model (swinv2_tiny_window8_256, ...:
its window and pre-training windows); ``--checkpoint`` may be in any format of that version
(detected from its keys: official, timm, torchvision, mmdet / mmpretrain, ours).

INPUT is an image file, a folder (searched recursively) or a glob. For each image, OUT_DIR
gets, at the image's relative path: ``NAME.npz`` (all stages) or ``NAME.stage{i}.npy|.pt``,
and with ``--png`` a ``NAME.stage{i}.png`` per stage (the image beside the first three
principal components of the features as RGB). ``--pool avg`` also writes one mean-pooled
vector per image and stage into ``pooled/shard-RRRRR-of-WWWWW.npz`` (one file per rank, with
its image list); ``--no-maps`` then skips the per-image maps. ``index.json`` and ``index.csv``
list image, stage, shape, dtype and file.

Images are decoded (and resized) in DataLoader worker processes (``--workers``); a batch
holds images of one input size. A rerun skips images whose outputs are complete (each file
is checked: a file cut off by a crash is redone), ``--overwrite`` redoes everything, and the
index is rebuilt from what is on disk. Under torchrun each rank takes a disjoint share of
the sorted image list (``paths[rank::world_size]``), one GPU per rank with ``--device cuda``;
rank 0 writes the index once every rank has finished. Unreadable images are reported (once)
and skipped. Every file is written to a temporary name and renamed. Nothing is downloaded.

Without ``--checkpoint`` the backbone would have random weights and the features would
mean nothing: that takes ``--random-weights`` (and is flagged in ``index.json``).
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import traceback
from typing import Optional, Sequence

from ..checkpoint.remote import is_reference
from ..features import DTYPES, arch_names, default_window_size, split_arch
from ..images import READERS
from .common import one_line
from .extraction.distributed import init_distributed
from .extraction.loading import ImageJobs  # noqa: F401  (as before the split: the decoding dataset)
from .extraction.orchestration import RankFailed, run
from .extraction.outputs import OutputPlan  # noqa: F401  (as before the split: one image's files)
from .job import in_job, leave_job


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="swin-extract-features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="image file, folder or glob")
    p.add_argument("out_dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--arch", default="tiny", help=f"Swin preset (default: tiny). {arch_names()}")
    src.add_argument("--config", help="mmdet / mmseg config whose backbone to use")
    p.add_argument("--embed-dims", type=int, help="override the preset's embed_dims (with --arch)")
    p.add_argument("--depths", type=int, nargs="+", help="override the preset's depths (with --arch)")
    p.add_argument("--num-heads", type=int, nargs="+", help="override the preset's num_heads (with --arch)")
    p.add_argument("--checkpoint", help="weights: any Swin format, or a whole detector/segmentor checkpoint; a file, "
                   "or a URL / torchvision:// / open-mmlab:// / mmcls:// reference as in mmengine (downloaded once "
                   "into torch's hub cache)")
    p.add_argument("--random-weights", action="store_true",
                   help="run without --checkpoint, on random weights (seeded by --seed): for testing only")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-weights (default: 0)")
    p.add_argument("--window-size", type=int, help="attention window (with --arch; default: 7 for Swin V1, 8 for "
                   "a V2 preset, a published V2 model's own)")
    p.add_argument("--pretrained-window-sizes", type=int, nargs="+", metavar="W",
                   help="Swin V2: the window(s) the checkpoint was pre-trained with (one, or one per stage), "
                   "for a larger --window-size (default: a published model's, else the window itself)")
    p.add_argument("--stages", type=int, nargs="+", help="output stages to keep (default: all)")
    p.add_argument("--resize", type=int, nargs=2, metavar=("H", "W"), help="resize every image (default: keep size)")
    p.add_argument("--mean", type=float, nargs=3, metavar=("R", "G", "B"),
                   help="normalisation mean, 0..255 scale (default: the --config's data preprocessor's, "
                   "else ImageNet's)")
    p.add_argument("--std", type=float, nargs=3, metavar=("R", "G", "B"),
                   help="normalisation std, 0..255 scale, > 0 (default: as --mean)")
    p.add_argument("--reader", choices=READERS, default="auto",
                   help="image decoding: mmcv (as mmdet's / mmseg's LoadImageFromFile: EXIF orientation, 16-bit, "
                   "palette, CMYK...), pil (the same conversions with Pillow, for installs without mmcv) or auto "
                   "(mmcv where installed; default)")
    p.add_argument("--batch-size", type=int, default=4, help="images per forward, all of one input size (default: 4)")
    p.add_argument("--workers", type=int, help="decoding processes per rank (default: CUDA: the rank's share of "
                   "the cores minus one, 1..8; CPU: 1 from 4 cores per rank, else 0 = decode in the main process)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK per rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--attention", choices=("auto", "sdpa", "triton"),
                   help="the attention kernel on CUDA (default: the backbone's, 'auto': measured on this GPU; "
                        "SWIN_BACKBONE_ATTENTION overrides it)")
    p.add_argument("--format", choices=("npz", "npy", "pt"), default="npz")
    p.add_argument("--png", action="store_true", help="also write a PCA visualisation per stage")
    p.add_argument("--pool", choices=("avg",), help="also write one mean-pooled vector per image and stage "
                   "into pooled/shard-RRRRR-of-WWWWW.npz (one file per rank, with its image list)")
    p.add_argument("--no-maps", action="store_true", help="write no per-image feature maps (with --pool or --png)")
    p.add_argument("--overwrite", action="store_true", help="redo every image (default: skip complete outputs)")
    p.add_argument("--dist-timeout", type=float, default=720.0, metavar="MIN",
                   help="how long ranks wait for each other under torchrun, in minutes (default: 720)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no model and no image: a usage error (exit status 2) names the
    option, what it expects and what it got, before anything is loaded."""
    from ..features import check_device, check_stages
    from ..validation import MAX_WINDOW_SIZE

    check_paths(p, args.input, args.out_dir)
    if args.config and not os.path.isfile(args.config):
        p.error(f"--config: no such file {args.config!r}")
    if not args.checkpoint and not args.random_weights:
        p.error("--checkpoint: none given, so the backbone would have random weights and every feature would be "
                "meaningless; pass --checkpoint FILE (any Swin format, or a detector/segmentor checkpoint), or "
                "--random-weights if random weights are really what you want")
    if args.checkpoint and args.random_weights:
        p.error("--random-weights: not allowed with --checkpoint")
    if args.checkpoint and not is_reference(args.checkpoint) and not os.path.isfile(args.checkpoint):
        p.error(f"--checkpoint: {'a folder, expected a file' if os.path.isdir(args.checkpoint) else 'no such file'} "
                f"{args.checkpoint!r}")
    for option, values in (("--embed-dims", [args.embed_dims] if args.embed_dims is not None else None),
                           ("--depths", args.depths), ("--num-heads", args.num_heads),
                           ("--pretrained-window-sizes", args.pretrained_window_sizes)):
        low = 0 if option == "--pretrained-window-sizes" else 1
        if values is not None and min(values) < low:
            p.error(f"{option}: expected ints >= {low}, got {' '.join(map(str, values))}")
    if args.depths and args.num_heads and len(args.depths) != len(args.num_heads):
        p.error(f"--num-heads: expected one per stage ({len(args.depths)} --depths), got {len(args.num_heads)}")
    if args.window_size is not None and not 1 <= args.window_size <= MAX_WINDOW_SIZE:
        p.error(f"--window-size: expected an int in [1, {MAX_WINDOW_SIZE}], got {args.window_size}")
    try:
        check_device(args.device)
    except ValueError as err:
        p.error(f"--{err}")
    for option, values in (("--mean", args.mean), ("--std", args.std)):
        if values is not None and not all(math.isfinite(v) and (v > 0 or option == "--mean") for v in values):
            p.error(f"{option}: expected 3 finite numbers{' > 0' if option == '--std' else ''}, "
                    f"got {' '.join(map(str, values))}")
    if args.stages is not None and not args.config:
        outputs = len(args.depths) if args.depths else 4  # --arch: every stage is an output
        try:
            check_stages(args.stages, outputs)
        except ValueError as err:
            p.error(f"--{err}")
    elif args.stages is not None:
        try:
            check_stages(args.stages, None)
        except ValueError as err:
            p.error(f"--{err}")
    if args.config and (args.embed_dims or args.depths or args.num_heads):
        p.error("--embed-dims/--depths/--num-heads: only with --arch, not --config")
    if args.config and (args.window_size is not None or args.pretrained_window_sizes is not None):
        p.error("--window-size/--pretrained-window-sizes: only with --arch, not --config (the config sets them)")
    if not args.config:
        version, _ = split_arch(args.arch)
        if args.pretrained_window_sizes is not None and version != 2:
            p.error(f"--pretrained-window-sizes: only for Swin V2 presets (v2-tiny, ...), got --arch {args.arch}")
        if args.pretrained_window_sizes is not None and len(args.pretrained_window_sizes) == 1:
            args.pretrained_window_sizes = args.pretrained_window_sizes[0]
        if args.window_size is None:
            args.window_size = default_window_size(args.arch)
    if args.batch_size < 1:
        p.error(f"--batch-size: expected >= 1, got {args.batch_size}")
    if args.workers is not None and args.workers < 0:
        p.error(f"--workers: expected >= 0, got {args.workers}")
    if args.resize and min(args.resize) < 1:
        p.error(f"--resize: expected two sizes >= 1, got {args.resize}")
    if args.no_maps and not (args.pool or args.png):
        p.error("--no-maps: nothing would be written; add --pool avg (or --png)")
    if not math.isfinite(args.dist_timeout) or args.dist_timeout <= 0:
        p.error(f"--dist-timeout: expected > 0 minutes, got {args.dist_timeout}")


def check_paths(p: argparse.ArgumentParser, input_spec: str, out_dir: str) -> None:
    """INPUT exists (a file, a folder or a glob); OUT_DIR is (or can become) a folder that is
    not INPUT itself nor one of the input images."""
    if not (os.path.exists(input_spec) or glob.has_magic(input_spec)):
        p.error(f"input: no such file or folder {input_spec!r} (expected an image file, a folder or a glob)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        p.error(f"out_dir: {out_dir!r} is a file; expected a folder (created if missing)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        p.error(f"out_dir: {out_dir!r} cannot be created: {parent!r} is a file, not a folder")
    if not os.access(parent if not os.path.exists(out_dir) else out_dir, os.W_OK | os.X_OK):
        p.error(f"out_dir: {out_dir!r} is not writable")
    if os.path.isdir(input_spec) and os.path.realpath(input_spec) == os.path.realpath(out_dir):
        p.error(f"out_dir: {out_dir!r} is the input folder itself; expected another folder (a subfolder is "
                "fine: it is never searched for images)")


def extract(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` and extract: rank 0's summary (``index.json``'s content) or, on other
    ranks, the rank's own state. Errors raise (usage errors: ``SystemExit(2)``); for the
    command line use :func:`main`."""
    args = parse_args(argv)
    ctx = init_distributed(args.dist_timeout)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun shows the failing rank's traceback
        from torch.distributed.elastic.multiprocessing.errors import record

        result = record(run)(args, ctx)
    else:
        result = run(args, ctx)
    ctx.barrier()  # every rank done (rank 0 has written the index)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point (``swin-extract-features``): the exit status. 0: done (a
    summary on stdout, the index in OUT_DIR); 2: a usage error (argparse); 1: a failure, said
    in one line on stderr (also when not one image could be read).

    Under torchrun the process ends here, without tearing the process group down
    (:func:`~swin_backbone.tools.job.leave_job`)."""
    try:
        code = _main(argv)
    except BaseException as err:  # (a usage error comes before the job is joined)
        if not in_job():
            raise
        if not isinstance(err, SystemExit):
            traceback.print_exc()
        code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1
    leave_job(code)
    return code


def _main(argv: Optional[Sequence[str]]) -> int:
    prog = "swin-extract-features"
    try:
        summary = extract(argv)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # our own SystemExit("why"): one line, status 1
            print(f"{prog}: error: {exit_.code}", file=sys.stderr)
            return 1
        raise  # argparse: its usage message and status 2
    except RankFailed:
        return 1  # run() already said which rank, why, and how to finish
    except (ValueError, OSError, RuntimeError) as err:
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        return 1
    if summary.get("failed") and not summary.get("images") and "rank" not in summary:
        print(f"{prog}: error: none of the {len(summary['failed'])} images could be read (each is listed above "
              "and in index.json 'failed')", file=sys.stderr)
        return 1
    return 0


def _one_line(err: BaseException) -> str:
    text = one_line(err) or type(err).__name__
    return text if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
