"""Turn images into multi-scale Swin feature maps, from a folder of ten to a whole dataset.

    swin-extract-features INPUT OUT_DIR --arch tiny --checkpoint swin_t.pth
    swin-extract-features INPUT OUT_DIR --arch v2-tiny --checkpoint swinv2_tiny_patch4_window8_256.pth
    python -m swin_backbone.tools.extract_features 'photos/*.jpg' feats --config configs/mmdet/X.py --checkpoint det.pth
    torchrun --nproc-per-node 8 -m swin_backbone.tools.extract_features coco/train2017 feats --checkpoint swin_t.pth --device cuda --pool avg

``--arch`` names a Swin V1 preset (tiny, small, base, large; window 7), a Swin V2 preset
(v2-tiny ... v2-giant; window 8) or a published Swin V2 model (swinv2_tiny_window8_256, ...:
its window and pre-training windows); ``--checkpoint`` may be in any format of that version
(detected from its keys: official, timm, torchvision, mmdet / mmpretrain, ours).

INPUT is an image file, a folder (searched recursively) or a glob. OUT_DIR gets, at each image's
relative path, ``NAME.npz`` (all stages) or ``NAME.stage{i}.npy|.pt``, and with ``--png`` a
``NAME.stage{i}.png`` per stage (the image beside the first three principal components of the
features). ``--pool avg`` writes one mean-pooled vector per image and stage into
``pooled/shard-RRRRR-of-WWWWW.npz`` (one file per rank); ``--no-maps`` then skips the maps.
``index.json`` / ``index.csv`` list every map. A rerun skips images whose outputs are complete;
under torchrun each rank takes ``sorted(paths)[rank::world_size]`` (docs/feature-extraction.md).

Without ``--checkpoint`` the backbone would have random weights and the features would
mean nothing: that takes ``--random-weights`` (and is flagged in ``index.json``).
"""
from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import io
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader

from ..checkpoint.files import atomic_write
from ..checkpoint.remote import fetch, is_reference, resolve
from ..features import DTYPES, IMAGENET_MEAN, IMAGENET_STD, FeatureExtractor, arch_names, default_window_size, mean_pool
from ..features import split_arch
from .common import one_line
from .extraction import (IMAGE_EXTS, READERS, ImageJobs, LoaderSettings, OutputPlan, PooledStore, as_is,
                         default_workers, find_images, inside, loader_settings, output_names, resolve_reader)
from .job import DistContext, in_job, init_distributed, leave_job

PROG = "swin-extract-features"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
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
    p.add_argument("--batch-size", type=int, default=4,
                   help="images per forward: of one input size on the CPU, of mixed sizes on GPUs (default: 4)")
    p.add_argument("--workers", type=int, help="decoding processes per rank (default: CUDA: the rank's share of "
                   "the cores minus one, 1..8; CPU: 1 from 4 cores per rank, else 0 = decode in the main process)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK per rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--attention", choices=("auto", "sdpa"),
                   help="the attention kernel (default: the backbone's; 'auto' = 'sdpa'; SWIN_BACKBONE_ATTENTION "
                        "overrides it)")
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
    if args.stages is not None:
        try:  # --arch: every stage is an output; --config: known once the backbone is built
            check_stages(args.stages, None if args.config else len(args.depths) if args.depths else 4)
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
    ranks, the rank's own record. Errors raise (usage errors: ``SystemExit(2)``); for the
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
    in one line on stderr (also when not one image could be read). Under torchrun the process
    ends here, without tearing the process group down (:func:`~swin_backbone.tools.job.leave_job`)."""
    code = 1
    try:
        summary = extract(argv)
        code = 0
        if summary.get("failed") and not summary.get("images") and "rank" not in summary:
            print(f"{PROG}: error: none of the {len(summary['failed'])} images could be read (each is listed above "
                  "and in index.json 'failed')", file=sys.stderr)
            code = 1
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # our own SystemExit("why"): one line, status 1
            print(f"{PROG}: error: {exit_.code}", file=sys.stderr)
        elif not in_job():
            raise  # argparse: its usage message and status 2
    except RankFailed:
        pass  # run() already said which rank, why, and how to finish
    except (ValueError, OSError, RuntimeError) as err:
        text = one_line(err) or type(err).__name__
        print(f"{PROG}: error: {text if isinstance(err, (ValueError, OSError)) else f'{type(err).__name__}: {text}'}",
              file=sys.stderr)
    except BaseException:
        if not in_job():
            raise
        traceback.print_exc()
    leave_job(code)
    return code


# -------------------------------------------------------------------------------- one run
RANDOM_WEIGHTS_WARNING = ("RANDOM WEIGHTS: no --checkpoint was given (--random-weights), so these features come "
                          "from an untrained backbone and mean nothing for retrieval, probing or visualisation")


class RankFailed(RuntimeError):
    """A rank stopped on an error; its message (already printed) says why and how to finish."""


@dataclass
class Share:
    """One rank's images and what became of them (its record: ``ranks/rank-RRRRR-of-WWWWW.json``)."""

    rank: int
    world_size: int
    paths: List[str]
    rows: Dict[int, List[dict]] = field(default_factory=dict)  # image index -> index rows
    failed: Dict[int, str] = field(default_factory=dict)  # image index -> error
    notes: List[str] = field(default_factory=list)  # images read, but with a remark (a cut-off JPEG)
    in_flight: List[str] = field(default_factory=list)
    new: int = 0
    resumed: int = 0

    def record(self, out_dir: str, status: str, error: Optional[str] = None, **extra: object) -> dict:
        """Write and return the rank's record."""
        done = sorted(self.rows)
        info = dict(rank=self.rank, world_size=self.world_size, status=status, error=error, assigned=len(self.paths),
                    images=len(done), new=self.new, resumed=self.resumed, in_flight=self.in_flight,
                    failed=[dict(image=self.paths[i], error=e) for i, e in sorted(self.failed.items())],
                    pending=[p for i, p in enumerate(self.paths) if i not in self.rows and i not in self.failed],
                    notes=self.notes, features=[r for i in done for r in self.rows[i]], **extra)
        name = f"rank-{self.rank:05d}-of-{self.world_size:05d}.json"
        atomic_write(os.path.join(out_dir, "ranks", name), json.dumps(info, indent=1).encode())
        return info


def run(args: argparse.Namespace, ctx: DistContext) -> dict:
    """Extract this rank's share; on rank 0, merge and return the job's summary (other ranks:
    their own record)."""
    start = time.perf_counter()
    paths, root = find_images(args.input, exclude=args.out_dir)
    if not paths:
        raise SystemExit(f"input {args.input!r}: no images found (files ending in {', '.join(IMAGE_EXTS)}"
                         + (f"; {args.out_dir!r} is OUT_DIR, not searched" if inside(args.out_dir, args.input) else "")
                         + ")")
    try:
        names = output_names(paths, root)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.workers is None:
        args.workers = default_workers(ctx.local_world_size, args.device)
    preprocessing(args)
    extractor = build_extractor(args, rank_device(args, ctx))
    channels = {s: f.shape[0] for s, f in extractor.run_batch([torch.zeros(3, 64, 64)])[0].items()}
    plan = OutputPlan(args.out_dir, root, args.format, channels, maps=not args.no_maps, png=args.png, names=names)
    warnings = [RANDOM_WEIGHTS_WARNING] if args.random_weights else []
    for w in warnings if ctx.rank == 0 else ():
        print(f"WARNING: {w}", file=sys.stderr, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    check_settings(args, ctx, feature_settings(args, channels))

    share = Share(ctx.rank, ctx.world_size, paths[ctx.rank :: ctx.world_size])
    pooled = done_pooled = None
    if args.pool:
        pooled = PooledStore(args.out_dir, ctx.rank, ctx.world_size, channels)
        done_pooled = set() if args.overwrite else pooled.load_existing({plan.key(p) for p in share.paths})
    ctx.barrier()  # every rank has read the old pooled files before any are replaced
    try:
        extract_share(args, extractor, plan, share, pooled, done_pooled, show=ctx.rank == 0 and not args.no_progress)
    except Exception as err:
        if pooled is not None and pooled.unflushed:  # what this run did is kept for the rerun
            pooled.save(f"partial-{pooled.tag}-{pooled.run_id}.end.npz", pooled.unflushed)
        info = share.record(args.out_dir, "failed", f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        message = (f"rank {ctx.rank} of {ctx.world_size} failed" + (f" on {', '.join(share.in_flight)}"
                   if share.in_flight else "") + f": {info['error']}; {len(info['pending'])} of its "
                   f"{len(share.paths)} images are not done (listed under 'pending' in {args.out_dir}/ranks); "
                   "run the same command again to finish them")
        print(message, file=sys.stderr, flush=True)
        raise RankFailed(message) from err
    shard = None
    if pooled is not None:
        shard = pooled.write_shard([plan.key(share.paths[i]) for i in sorted(share.rows)])
        shard = os.path.relpath(shard, args.out_dir).replace(os.sep, "/")
    info = share.record(args.out_dir, "complete", pooled_file=shard)
    gathered = ctx.gather(info)  # waits for every rank
    if ctx.rank != 0 or gathered is None:
        return info
    summary = write_index(args, gathered, paths, time.perf_counter() - start, warnings)
    PooledStore.remove_stale(args.out_dir, ctx.world_size)
    for stale in set(glob.glob(os.path.join(args.out_dir, "ranks", "rank-*.json"))) - set(
            glob.glob(os.path.join(args.out_dir, "ranks", f"rank-*-of-{ctx.world_size:05d}.json"))):
        os.remove(stale)  # records of runs with another world size
    for item in summary["failed"]:
        print(f"skipped {item['image']}: {item['error']}", file=sys.stderr)
    for note in summary["notes"]:
        print(f"warning: {note}", file=sys.stderr)
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"done: {summary['images']} images ({summary['new']} new, {summary['resumed']} already complete) on "
          f"{ctx.world_size} rank(s) in {summary['seconds']:.1f} s ({summary['images_per_second']:.2f} new img/s), "
          f"{len(summary['failed'])} skipped, images read with {summary['reader']}", flush=True)
    print(f"index: {os.path.join(args.out_dir, 'index.json')} (and index.csv)", flush=True)
    return summary


def extract_share(args: argparse.Namespace, extractor: FeatureExtractor, plan: OutputPlan, share: Share,
                  pooled: Optional[PooledStore], done_pooled: Optional[set], show: bool) -> None:
    """The rank's loop: DataLoader workers decode (or find an image's outputs complete); the
    main process batches what they decoded as :meth:`FeatureExtractor.batches` does (mixed sizes
    where the backbone takes per-image valid sizes, else by size), runs the backbone and writes."""
    from rich.console import Console
    from rich.progress import track

    jobs = ImageJobs(share.paths, plan, tuple(args.resize) if args.resize else None, skip_complete=not args.overwrite,
                     pooled=done_pooled, reader=args.reader, loader=args.loader)
    chunk = 8 * args.batch_size  # decoded images batched together (the workers decode the next ones meanwhile)
    ahead = dict(prefetch_factor=max(2, -(-chunk // args.workers))) if args.workers else {}
    loader = DataLoader(jobs, batch_size=None, num_workers=args.workers, collate_fn=as_is,
                        pin_memory=extractor.device.type == "cuda", **ahead)
    items = iter(loader)  # (the workers start before the bar's refresh thread)
    if show:
        items = track(items, total=len(jobs), description="extracting" if share.world_size == 1 else
                      f"rank 0's share of {share.world_size}", console=Console(stderr=True))
    waiting: List[dict] = []  # decoded images, batched by FeatureExtractor.batches (by size, or mixed sizes)

    def run_batch(batch: List[dict]) -> None:
        share.in_flight = [share.paths[it["i"]] for it in batch]
        for it, feat in zip(batch, extractor.run_batch([it["image"] for it in batch])):
            path = share.paths[it["i"]]
            share.in_flight = [path]
            share.rows[it["i"]] = plan.write(path, feat, it["shown"])
            if pooled is not None:
                pooled.add(plan.key(path), mean_pool(feat))
            share.new += 1
        share.in_flight = []

    def run_waiting() -> None:
        for batch in extractor.batches([tuple(it["image"].shape[-2:]) for it in waiting]):
            run_batch([waiting[i] for i in batch])
        waiting.clear()

    for item in items:
        if item["status"] == "done":
            share.rows[item["i"]] = item["rows"]
            share.resumed += 1
        elif item["status"] == "failed":
            share.failed[item["i"]] = item["error"]
        else:
            share.notes += [item["note"]] if item["note"] else []
            waiting.append(item)
            if len(waiting) >= chunk:
                run_waiting()
    run_waiting()


def write_index(args: argparse.Namespace, records: List[dict], paths: List[str], seconds: float,
                warnings: List[str]) -> dict:
    """Rank 0: ``index.json`` (the summary) and ``index.csv`` of the whole job, from every rank's record."""
    order = {p: i for i, p in enumerate(paths)}
    rows = sorted((r for s in records for r in s["features"]), key=lambda r: (order[r["image"]], r["stage"], r["file"]))
    new = sum(s["new"] for s in records)
    summary = dict(images=sum(s["images"] for s in records), new=new, resumed=sum(s["resumed"] for s in records),
                   failed=sorted((f for s in records for f in s["failed"]), key=lambda f: order[f["image"]]),
                   notes=[n for s in records for n in s["notes"]], reader=reader_label(args), seconds=round(seconds, 3),
                   images_per_second=round(new / max(seconds, 1e-9), 3), world_size=len(records),
                   workers=args.workers, batch_size=args.batch_size, warnings=warnings,
                   weights=dict(checkpoint=args.checkpoint, random=bool(args.random_weights),
                                seed=args.seed if args.random_weights else None),
                   pooled=[dict(file=s["pooled_file"], images=s["images"], rank=s["rank"]) for s in records
                           if s["pooled_file"]],
                   ranks=[{k: s[k] for k in ("rank", "assigned", "images", "new", "resumed")} for s in records],
                   features=rows)
    atomic_write(os.path.join(args.out_dir, "index.json"), json.dumps(summary, indent=1).encode())
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["image", "stage", "shape", "dtype", "file", "key"])
    writer.writeheader()
    writer.writerows(dict(row, shape="x".join(map(str, row["shape"]))) for row in rows)
    atomic_write(os.path.join(args.out_dir, "index.csv"), buf.getvalue().encode())
    return summary


# ------------------------------------------------------ what decides the features' values
def feature_settings(args: argparse.Namespace, channels: Dict[int, int]) -> dict:
    """What decides the features' values: a rerun into the same OUT_DIR must match it."""
    ckpt = None
    if args.checkpoint:
        path, name = args.checkpoint, os.path.basename(args.checkpoint)
        if is_reference(args.checkpoint):  # a URL: its cached file (downloaded once), named by the URL
            path, name = (fetch(args.checkpoint)[0] if resolve(args.checkpoint)[0] != "mmengine" else None), path
        digest = hashlib.sha256()
        if path is not None:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 23), b""):
                    digest.update(chunk)
        ckpt = dict(file=name, sha256=digest.hexdigest() if path is not None else None)
    model = dict(arch=args.arch, embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                 window_size=args.window_size)
    if args.pretrained_window_sizes is not None:  # (V2 only; absent otherwise, as before V2 existed)
        model["pretrained_window_sizes"] = args.pretrained_window_sizes
    return dict(model=dict(config=os.path.abspath(args.config)) if args.config else model,
                checkpoint=ckpt, random_weights_seed=args.seed if args.random_weights else None,
                stages={str(s): c for s, c in channels.items()}, resize=args.resize, mean=list(args.mean),
                std=list(args.std), dtype=args.dtype, reader=args.reader)


def check_settings(args: argparse.Namespace, ctx: DistContext, settings: dict) -> None:
    """Refuse an OUT_DIR that holds features made with other ``settings`` (unless ``--overwrite``),
    then (rank 0) record these in ``settings.json``."""
    path = os.path.join(args.out_dir, "settings.json")
    if not args.overwrite and os.path.isfile(path):
        with open(path) as f:
            previous = json.load(f)
        current = json.loads(json.dumps(settings))  # (as it would read back: lists for tuples)
        if previous != current:
            diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            raise SystemExit(f"out_dir {args.out_dir!r}: holds features made with other settings ({', '.join(diff)} "
                             f"differ, see {path}); pass --overwrite to redo everything, or use another OUT_DIR")
    ctx.barrier()  # every rank has compared before rank 0 replaces the file
    if ctx.rank == 0:
        atomic_write(path, json.dumps(settings, indent=1).encode())


def build_extractor(args: argparse.Namespace, device: str) -> FeatureExtractor:
    common = dict(stages=args.stages, mean=args.mean, std=args.std, resize=args.resize,
                  batch_size=args.batch_size, device=device, dtype=args.dtype, seed=args.seed)
    if args.config:
        return FeatureExtractor.from_config(args.config, args.checkpoint, attention=args.attention, **common)
    if args.attention is not None:
        common["attention"] = args.attention
    return FeatureExtractor.from_arch(args.arch, args.checkpoint, window_size=args.window_size,
                                      embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                                      pretrained_window_sizes=args.pretrained_window_sizes, **common)


def rank_device(args: argparse.Namespace, ctx: DistContext) -> str:
    """The device this rank runs on: under torchrun with CUDA, cuda:LOCAL_RANK (made current)."""
    if torch.device(args.device).type == "cuda" and ctx.world_size > 1:
        if torch.device(args.device).index is not None:
            raise SystemExit(f"--device {args.device}: under torchrun each rank uses cuda:LOCAL_RANK; "
                             "pass --device cuda")
        torch.cuda.set_device(ctx.local_rank)
        return f"cuda:{ctx.local_rank}"
    return args.device


def reader_label(args: argparse.Namespace) -> str:
    """How images were decoded, for the summary: mmcv's loader settings, or the Pillow fallback."""
    if args.reader == "mmcv":
        return f"mmcv ({args.loader.imdecode_backend}, color_type={args.loader.color_type!r}, as LoadImageFromFile)"
    return "Pillow (mmcv not installed: EXIF orientation and conversions as mmcv's)"


def preprocessing(args: argparse.Namespace) -> None:
    """Decoder, loader settings and mean / std: with ``--config``, its test pipeline's
    ``LoadImageFromFile`` and its data preprocessor's (unless --mean / --std are given)."""
    args.reader = resolve_reader(args.reader)
    args.loader = LoaderSettings()
    if args.config:
        from mmengine.config import Config

        cfg = Config.fromfile(args.config)
        args.loader = loader_settings(cfg)
        preprocessor = (cfg.get("model") or {}).get("data_preprocessor") or {}
        if args.mean is None and preprocessor.get("mean") is not None:
            args.mean = [float(v) for v in preprocessor["mean"]]
        if args.std is None and preprocessor.get("std") is not None:
            args.std = [float(v) for v in preprocessor["std"]]
    args.mean = list(IMAGENET_MEAN) if args.mean is None else args.mean
    args.std = list(IMAGENET_STD) if args.std is None else args.std


if __name__ == "__main__":
    sys.exit(main())
