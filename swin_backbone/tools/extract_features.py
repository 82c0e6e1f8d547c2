"""Turn images into multi-scale Swin feature maps, from a folder of ten to a whole dataset.

    swin-extract-features INPUT OUT_DIR --arch tiny --checkpoint swin_t.pth
    swin-extract-features 'photos/*.jpg' OUT_DIR --config configs/mmdet/X.py --checkpoint det.pth
    torchrun --nproc-per-node 8 -m swin_backbone.tools.extract_features INPUT OUT_DIR --checkpoint F --device cuda

INPUT is an image file, a folder (searched recursively) or a glob; ``--checkpoint`` any Swin
format of the arch's version (official, timm, torchvision, mmdet / mmpretrain, ours). OUT_DIR
gets, at each image's relative path, ``NAME.npz`` (all stages) or ``NAME.stage{i}.npy|.pt`` (and
``NAME.stage{i}.png`` with ``--png``), ``pooled/shard-RRRRR-of-WWWWW.npz`` with ``--pool avg``,
and ``index.json`` / ``index.csv``. A rerun skips images whose outputs are complete; under
torchrun each rank takes ``sorted(paths)[rank::world_size]`` (docs/feature-extraction.md).
"""
from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import mmap
import os
import sys
import time
import traceback
from itertools import chain
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import track
from torch.utils.data import DataLoader

from ..checkpoint.files import atomic_path, atomic_write
from ..checkpoint.remote import fetch, is_reference, resolve
from ..features import (DTYPES, IMAGENET_MEAN, IMAGENET_STD, FeatureExtractor, arch_names, check_device, check_stages,
                        default_window_size, mean_pool, split_arch)
from ..validation import MAX_WINDOW_SIZE
from .common import arg_type, int_arg, number_arg, one_line
from .extraction import (IMAGE_EXTS, READERS, ImageJobs, LoaderSettings, OutputPlan, PooledStore, as_is,
                         default_workers, find_images, inside, loader_settings, output_names, resolve_reader)
from .job import DistContext, in_job, init_distributed, leave_job

PROG = "swin-extract-features"
RANDOM_WEIGHTS_WARNING = ("RANDOM WEIGHTS: no --checkpoint was given (--random-weights), so these features come "
                          "from an untrained backbone and mean nothing for retrieval, probing or visualisation")


# ------------------------------------------------------------------- the command line
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line, checked as far as it can be before any model or image is loaded (errors: status 2)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="image file, folder or glob")
    p.add_argument("out_dir")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--arch", default="tiny", help=f"Swin preset (default: tiny). {arch_names()}")
    model.add_argument("--config", help="mmdet / mmseg config whose backbone to use")
    for name, nargs in (("embed-dims", None), ("depths", "+"), ("num-heads", "+")):
        p.add_argument(f"--{name}", type=int_arg(1), nargs=nargs,
                       help=f"override the preset's {name.replace('-', '_')} (with --arch)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", help="weights in any Swin format, or a detector/segmentor checkpoint: a file, "
                         "or a URL / torchvision:// / open-mmlab:// / mmcls:// reference (downloaded once)")
    weights.add_argument("--random-weights", action="store_true",
                         help="run without --checkpoint, on random weights (seeded by --seed): for testing only")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-weights (default: 0)")
    p.add_argument("--window-size", type=int_arg(1, MAX_WINDOW_SIZE), help="attention window (with --arch; "
                   "default: 7 for Swin V1, 8 for a V2 preset, a published V2 model's own)")
    p.add_argument("--pretrained-window-sizes", type=int_arg(0), nargs="+", metavar="W",
                   help="Swin V2: the window(s) the checkpoint was pre-trained with (one, or one per stage), "
                   "for a larger --window-size (default: a published model's, else the window itself)")
    p.add_argument("--stages", type=int, nargs="+", help="output stages to keep (default: all)")
    p.add_argument("--resize", type=int_arg(1), nargs=2, metavar=("H", "W"), help="resize every image (default: keep)")
    p.add_argument("--mean", type=number_arg(), nargs=3, metavar=("R", "G", "B"), help="normalisation mean, 0..255 "
                   "scale (default: the --config's data preprocessor's, else ImageNet's)")
    p.add_argument("--std", type=number_arg(positive=True), nargs=3, metavar=("R", "G", "B"),
                   help="normalisation std, 0..255 scale (default: as --mean)")
    p.add_argument("--reader", choices=READERS, default="auto", help="image decoding: mmcv (as LoadImageFromFile: "
                   "EXIF orientation, 16-bit, palette, CMYK...), pil (the same with Pillow), auto (mmcv if installed)")
    p.add_argument("--batch-size", type=int_arg(1), default=4,
                   help="images per forward: of one input size on the CPU, of mixed sizes on GPUs (default: 4)")
    p.add_argument("--workers", type=int_arg(0), help="decoding processes per rank (default: CUDA: the rank's share "
                   "of the cores minus one, 1..8; CPU: 1 from 4 cores per rank, else 0 = decode in the main process)")
    p.add_argument("--device", type=arg_type(str, check_device), default="cpu",
                   help="cpu or cuda (under torchrun: cuda:LOCAL_RANK per rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--attention", choices=("auto", "sdpa"), help="the attention kernel (default: the backbone's; "
                   "'auto' = 'sdpa'; SWIN_BACKBONE_ATTENTION overrides it)")
    p.add_argument("--format", choices=("npz", "npy", "pt"), default="npz")
    p.add_argument("--png", action="store_true", help="also write a PCA visualisation per stage")
    p.add_argument("--pool", choices=("avg",), help="also write one mean-pooled vector per image and stage into "
                   "pooled/shard-RRRRR-of-WWWWW.npz (one file per rank, with its image list)")
    p.add_argument("--no-maps", action="store_true", help="write no per-image feature maps (with --pool or --png)")
    p.add_argument("--overwrite", action="store_true", help="redo every image (default: skip complete outputs)")
    p.add_argument("--dist-timeout", type=number_arg(positive=True), default=720.0, metavar="MIN",
                   help="how long ranks wait for each other under torchrun, in minutes (default: 720)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    # what argparse cannot check alone
    if not (os.path.exists(args.input) or glob.has_magic(args.input)):
        p.error(f"input: no such file or folder {args.input!r} (expected an image file, a folder or a glob)")
    existing = os.path.abspath(args.out_dir)  # OUT_DIR, or the folder it would be created in
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        p.error(f"out_dir: {existing!r} is a file; expected a folder (OUT_DIR {args.out_dir!r} is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        p.error(f"out_dir: {args.out_dir!r} is not writable")
    if os.path.isdir(args.input) and os.path.realpath(args.input) == os.path.realpath(args.out_dir):
        p.error(f"out_dir: {args.out_dir!r} is the input folder itself; expected another folder (a subfolder is "
                "fine: it is never searched for images)")
    if not args.checkpoint and not args.random_weights:
        p.error("--checkpoint: none given, so the backbone would have random weights and every feature would be "
                "meaningless; pass --checkpoint FILE (any Swin format, or a detector/segmentor checkpoint), or "
                "--random-weights if random weights are really what you want")
    for option, path in (("--config", args.config), ("--checkpoint", args.checkpoint)):
        if path and not os.path.isfile(path) and not (option == "--checkpoint" and is_reference(path)):
            p.error(f"{option}: {'a folder, expected a file' if os.path.isdir(path) else 'no such file'} {path!r}")
    if args.depths and args.num_heads and len(args.depths) != len(args.num_heads):
        p.error(f"--num-heads: expected one per stage ({len(args.depths)} --depths), got {len(args.num_heads)}")
    if args.stages is not None:
        try:  # --arch: every stage is an output; --config: known once the backbone is built
            check_stages(args.stages, None if args.config else len(args.depths) if args.depths else 4)
        except ValueError as err:
            p.error(f"--{err}")
    arch_only = ["--" + k.replace("_", "-") for k in ("embed_dims", "depths", "num_heads", "window_size",
                                                       "pretrained_window_sizes") if getattr(args, k) is not None]
    if args.config and arch_only:
        p.error(f"{'/'.join(arch_only)}: only with --arch, not --config (the config sets them)")
    if not args.config:
        if args.pretrained_window_sizes is not None and split_arch(args.arch)[0] != 2:
            p.error(f"--pretrained-window-sizes: only for Swin V2 presets (v2-tiny, ...), got --arch {args.arch}")
        if args.pretrained_window_sizes is not None and len(args.pretrained_window_sizes) == 1:
            args.pretrained_window_sizes = args.pretrained_window_sizes[0]
        args.window_size = args.window_size or default_window_size(args.arch)
    if args.no_maps and not (args.pool or args.png):
        p.error("--no-maps: nothing would be written; add --pool avg (or --png)")
    return args


def extract(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` and extract: rank 0's summary (``index.json``), other ranks' own record. Errors raise
    (usage errors: ``SystemExit(2)``); the command line is :func:`main`."""
    args = parse_args(argv)
    ctx = init_distributed(args.dist_timeout)
    body = run
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun then names the failing rank as the root cause
        from torch.distributed.elastic.multiprocessing.errors import record

        body = record(run)
    result = body(args, ctx)
    ctx.barrier()  # every rank done (rank 0 has written the index)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The exit status: 0 done (a summary on stdout, the index in OUT_DIR); 2 a usage error
    (argparse); 1 a failure, said in one line on stderr (also when not one image could be read).
    Under torchrun the process ends here (:func:`leave_job`)."""
    code = 1
    try:
        summary = extract(argv)
        code = 0
        if summary.get("failed") and not summary.get("images") and "rank" not in summary:
            print(f"{PROG}: error: none of the {len(summary['failed'])} images could be read (each is listed above "
                  "and in index.json 'failed')", file=sys.stderr)
            code = 1
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # our own SystemExit("why")
            print(f"{PROG}: error: {exit_.code}", file=sys.stderr)
        elif not in_job():
            raise  # argparse: its usage message and status 2
    except (ValueError, OSError, RankFailed) as err:
        print(f"{PROG}: error: {one_line(err) or type(err).__name__}", file=sys.stderr)
    except RuntimeError as err:
        print(f"{PROG}: error: {type(err).__name__}: {one_line(err)}", file=sys.stderr)
    except BaseException:
        if not in_job():
            raise
        traceback.print_exc()
    leave_job(code)
    return code


# --------------------------------------------------------------------------------- one run
class RankFailed(RuntimeError):
    """A rank stopped on an error; the message says which, why, and how to finish."""


def run(args: argparse.Namespace, ctx: DistContext) -> dict:
    """Extract this rank's share: DataLoader workers decode (or find an image's outputs complete); the main
    process batches what they decoded as :meth:`FeatureExtractor.batches` does, runs the backbone, writes.
    Rank 0 returns the job's summary, other ranks their record (``ranks/rank-RRRRR-of-WWWWW.json``)."""
    start = time.perf_counter()
    paths, root = find_images(args.input, exclude=args.out_dir)
    if not paths:
        raise SystemExit(f"input {args.input!r}: no images found (files ending in {', '.join(IMAGE_EXTS)}"
                         + (f"; {args.out_dir!r} is OUT_DIR, not searched" if inside(args.out_dir, args.input) else "")
                         + ")")
    names = output_names(paths, root)
    extractor = build_extractor(args, ctx)
    channels = {s: f.shape[0] for s, f in extractor.run_batch([torch.zeros(3, 64, 64)])[0].items()}
    plan = OutputPlan(args.out_dir, root, args.format, channels, maps=not args.no_maps, png=args.png, names=names)
    warnings = [RANDOM_WEIGHTS_WARNING] if args.random_weights else []
    for w in warnings if ctx.rank == 0 else ():
        print(f"WARNING: {w}", file=sys.stderr, flush=True)
    check_settings(args, ctx, channels)

    mine = paths[ctx.rank :: ctx.world_size]
    pooled = PooledStore(args.out_dir, ctx.rank, ctx.world_size, channels) if args.pool else None
    # (with --overwrite no image is skipped, whatever the old pooled files hold)
    done_pooled = pooled.load_existing({plan.key(p) for p in mine}) if pooled and not args.overwrite else None
    ctx.barrier()  # every rank has read the old pooled files before any are replaced
    rows: Dict[int, List[dict]] = {}  # image index in `mine` -> its index rows
    failed: Dict[int, str] = {}  # image index -> error
    notes: List[str] = []  # images read, but with a remark (a cut-off JPEG)
    in_flight: List[str] = []  # what the rank was doing if it stops
    resumed = 0

    def record(status: str, error: Optional[str] = None, **extra: object) -> dict:
        """Write and return the rank's record."""
        info = dict(rank=ctx.rank, world_size=ctx.world_size, status=status, error=error, assigned=len(mine),
                    images=len(rows), new=len(rows) - resumed, resumed=resumed, in_flight=in_flight,
                    failed=[dict(image=mine[i], error=e) for i, e in sorted(failed.items())],
                    pending=[p for i, p in enumerate(mine) if i not in rows and i not in failed],
                    notes=notes, features=[r for i in sorted(rows) for r in rows[i]], **extra)
        atomic_write(os.path.join(args.out_dir, "ranks", f"rank-{ctx.rank:05d}-of-{ctx.world_size:05d}.json"),
                     json.dumps(info, indent=1))
        return info

    try:
        jobs = ImageJobs(mine, plan, tuple(args.resize) if args.resize else None, skip_complete=not args.overwrite,
                         pooled=done_pooled, reader=args.reader, loader=args.loader)
        chunk = 8 * args.batch_size  # decoded images batched by size together, while the workers decode the next
        ahead = dict(prefetch_factor=max(2, -(-chunk // args.workers))) if args.workers else {}  # a chunk in flight
        # one image per item (batches form by size below); iter() forks the workers before the bar starts its thread
        items = iter(DataLoader(jobs, batch_size=None, collate_fn=as_is, num_workers=args.workers,
                                pin_memory=extractor.device.type == "cuda", **ahead))
        if ctx.rank == 0 and not args.no_progress:
            items = track(items, total=len(jobs), description="extracting" if ctx.world_size == 1 else
                          f"rank 0's share of {ctx.world_size}", console=Console(stderr=True))
        waiting: List[dict] = []
        for item in chain(items, [dict(status="end")]):  # the end: the images still waiting run
            if item["status"] == "done":
                rows[item["i"]] = item["rows"]
                resumed += 1
            elif item["status"] == "failed":
                failed[item["i"]] = item["error"]
            elif item["status"] == "ok":
                notes += [item["note"]] if item["note"] else []
                waiting.append(item)
            if waiting and (item["status"] == "end" or len(waiting) >= chunk):
                for batch in extractor.batches([tuple(it["image"].shape[-2:]) for it in waiting]):
                    in_flight = [mine[waiting[j]["i"]] for j in batch]
                    for j, feat in zip(batch, extractor.run_batch([waiting[j]["image"] for j in batch])):
                        i = waiting[j]["i"]
                        in_flight = [mine[i]]  # the forward is done: only this image's files are being written
                        rows[i] = plan.write(mine[i], feat, waiting[j]["image"])
                        if pooled is not None:
                            pooled.add(plan.key(mine[i]), mean_pool(feat))
                in_flight, waiting = [], []
    except Exception as err:
        if pooled is not None:  # what this run did is kept for the rerun
            pooled.flush()
        info = record("failed", f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        raise RankFailed(f"rank {ctx.rank} of {ctx.world_size} failed"
                         + (f" on {', '.join(in_flight)}" if in_flight else "")
                         + f": {info['error']}; {len(info['pending'])} of its {len(mine)} images are not done "
                         f"(listed under 'pending' in {args.out_dir}/ranks); run the same command again to finish "
                         "them") from err
    shard = pooled and pooled.save(f"shard-{pooled.tag}.npz", [plan.key(mine[i]) for i in sorted(rows)])
    info = record("complete", pooled_file=shard)
    gathered = ctx.gather(info)  # waits for every rank
    if ctx.rank != 0 or gathered is None:
        return info
    return finish(args, gathered, paths, time.perf_counter() - start, warnings)


def finish(args: argparse.Namespace, records: List[dict], paths: List[str], seconds: float,
           warnings: List[str]) -> dict:
    """Rank 0, every rank done: ``index.json`` (the summary, returned) and ``index.csv`` of the whole job from the
    ranks' records; the files of other runs removed; the summary said."""
    order = {p: i for i, p in enumerate(paths)}
    rows = sorted((r for s in records for r in s["features"]), key=lambda r: (order[r["image"]], r["stage"], r["file"]))
    total = {k: sum(s[k] for s in records) for k in ("images", "new", "resumed")}
    reader = (f"mmcv ({args.loader.imdecode_backend}, color_type={args.loader.color_type!r}, as LoadImageFromFile)"
              if args.reader == "mmcv" else "Pillow (mmcv not installed: EXIF orientation and conversions as mmcv's)")
    summary = dict(**total, failed=sorted((f for s in records for f in s["failed"]), key=lambda f: order[f["image"]]),
                   notes=[n for s in records for n in s["notes"]], reader=reader, seconds=round(seconds, 3),
                   images_per_second=round(total["new"] / max(seconds, 1e-9), 3), world_size=len(records),
                   workers=args.workers, batch_size=args.batch_size, warnings=warnings,
                   weights=dict(checkpoint=args.checkpoint, random=bool(args.random_weights),
                                seed=args.seed if args.random_weights else None),
                   pooled=[dict(file=s["pooled_file"], images=s["images"], rank=s["rank"]) for s in records
                           if s["pooled_file"]],
                   ranks=[{k: s[k] for k in ("rank", "assigned", "images", "new", "resumed")} for s in records],
                   features=rows)
    atomic_write(os.path.join(args.out_dir, "index.json"), json.dumps(summary, indent=1))
    with atomic_path(os.path.join(args.out_dir, "index.csv")) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["image", "stage", "shape", "dtype", "file", "key"])
        writer.writeheader()
        writer.writerows(dict(row, shape="x".join(map(str, row["shape"]))) for row in rows)
    pool_dir, tail = Path(args.out_dir, "pooled"), f"-of-{len(records):05d}"
    for old in [*pool_dir.glob("shard-*.npz"), *pool_dir.glob("partial-*.npz"), *Path(args.out_dir, "ranks").iterdir()]:
        if not old.name.endswith((f"{tail}.npz", f"{tail}.json")):
            old.unlink()  # partial files; shards and records of a run with another world size
    said = [f"skipped {f['image']}: {f['error']}" for f in summary["failed"]]
    for line in said + [f"warning: {n}" for n in summary["notes"]] + [f"WARNING: {w}" for w in warnings]:
        print(line, file=sys.stderr)
    print(f"done: {summary['images']} images ({summary['new']} new, {summary['resumed']} already complete) on "
          f"{len(records)} rank(s) in {summary['seconds']:.1f} s ({summary['images_per_second']:.2f} new img/s), "
          f"{len(summary['failed'])} skipped, images read with {summary['reader']}\n"
          f"index: {os.path.join(args.out_dir, 'index.json')} (and index.csv)", flush=True)
    return summary


# ------------------------------------------------------ what decides the features' values
def check_settings(args: argparse.Namespace, ctx: DistContext, channels: Dict[int, int]) -> None:
    """Refuse an OUT_DIR that holds features made with other settings (what decides their values) unless
    ``--overwrite``, then (rank 0) record these in ``settings.json``."""
    checkpoint = None
    if args.checkpoint:
        local, sha256 = args.checkpoint, None
        if is_reference(local):  # its cached download; mmengine's own schemes have no local file
            local = fetch(local)[0] if resolve(local)[0] != "mmengine" else None
        if local:  # (mapped, not read: checkpoints reach GiBs)
            with open(local, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                sha256 = hashlib.sha256(data).hexdigest()
        name = args.checkpoint if is_reference(args.checkpoint) else os.path.basename(args.checkpoint)
        checkpoint = dict(file=name, sha256=sha256)
    model = dict(arch=args.arch, embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                 window_size=args.window_size)
    if args.pretrained_window_sizes is not None:  # (absent otherwise: OUT_DIRs written before V2 still match)
        model["pretrained_window_sizes"] = args.pretrained_window_sizes
    settings = dict(model=dict(config=os.path.abspath(args.config)) if args.config else model,
                    checkpoint=checkpoint, random_weights_seed=args.seed if args.random_weights else None,
                    stages={str(s): c for s, c in channels.items()}, resize=args.resize, mean=args.mean,
                    std=args.std, dtype=args.dtype, reader=args.reader)
    path = os.path.join(args.out_dir, "settings.json")
    if not args.overwrite and os.path.isfile(path):
        previous, current = json.loads(Path(path).read_text()), json.loads(json.dumps(settings))  # lists for tuples
        diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
        if diff:
            raise SystemExit(f"out_dir {args.out_dir!r}: holds features made with other settings ({', '.join(diff)} "
                             f"differ, see {path}); pass --overwrite to redo everything, or use another OUT_DIR")
    ctx.barrier()  # every rank has compared before rank 0 replaces the file
    if ctx.rank == 0:
        atomic_write(path, json.dumps(settings, indent=1))


def build_extractor(args: argparse.Namespace, ctx: DistContext) -> FeatureExtractor:
    """The rank's extractor; completes ``args``: the decoder, ``--workers``' default and, with
    ``--config``, its test pipeline's ``LoadImageFromFile`` and its data preprocessor's mean / std."""
    args.reader, args.loader = resolve_reader(args.reader), LoaderSettings()
    args.workers = default_workers(ctx.local_world_size, args.device) if args.workers is None else args.workers
    if args.config:
        from mmengine.config import Config

        cfg = Config.fromfile(args.config)
        args.loader = loader_settings(cfg)
        preprocessor = (cfg.get("model") or {}).get("data_preprocessor") or {}
        args.mean, args.std = args.mean or preprocessor.get("mean"), args.std or preprocessor.get("std")
    args.mean = [float(v) for v in args.mean or IMAGENET_MEAN]
    args.std = [float(v) for v in args.std or IMAGENET_STD]
    device = args.device
    if torch.device(device).type == "cuda" and ctx.world_size > 1:  # under torchrun: cuda:LOCAL_RANK
        if torch.device(device).index is not None:
            raise SystemExit(f"--device {device}: under torchrun each rank uses cuda:LOCAL_RANK; pass --device cuda")
        torch.cuda.set_device(ctx.local_rank)
        device = f"cuda:{ctx.local_rank}"
    common = dict(stages=args.stages, mean=args.mean, std=args.std, resize=args.resize, batch_size=args.batch_size,
                  device=device, dtype=args.dtype, seed=args.seed)
    if args.attention is not None:  # (else the config's, or the preset's default)
        common["attention"] = args.attention
    if args.config:
        return FeatureExtractor.from_config(args.config, args.checkpoint, **common)
    return FeatureExtractor.from_arch(args.arch, args.checkpoint, window_size=args.window_size,
                                      embed_dims=args.embed_dims, depths=args.depths, num_heads=args.num_heads,
                                      pretrained_window_sizes=args.pretrained_window_sizes, **common)


if __name__ == "__main__":
    sys.exit(main())
