"""One run of ``swin-extract-features`` on this rank: find the images, build the extractor, check
OUT_DIR's settings, extract the rank's share, and on rank 0 merge every rank's results."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict
from typing import Any, List, Optional

import torch

from ..common import atomic_write
from .distributed import DistContext
from .index import write_index
from .inputs import IMAGE_EXTS, find_images, inside, output_names
from .loading import default_workers
from .outputs import OutputPlan
from .pooled import PooledStore
from .progress import Progress
from .rank import RankState, extract_share
from .settings import build_extractor, check_settings, feature_settings, preprocessing, rank_device

RANDOM_WEIGHTS_WARNING = ("RANDOM WEIGHTS: no --checkpoint was given (--random-weights), so these features come "
                          "from an untrained backbone and mean nothing for retrieval, probing or visualisation")


class RankFailed(RuntimeError):
    """A rank stopped on an error; its message (already printed) says why and how to finish."""


class Terminated(Exception):
    """SIGTERM (torchrun stopping the job because another rank failed, or a scheduler)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"terminated by signal {signum}")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def run(args: argparse.Namespace, ctx: DistContext) -> dict:
    """Extract this rank's share; on rank 0, merge and return the job's summary (other ranks:
    their own state)."""
    wall_start = time.perf_counter()
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
    probe = extractor.run_batch([torch.zeros(3, 64, 64)])[0]
    channels = OrderedDict((s, f.shape[0]) for s, f in probe.items())
    plan = OutputPlan(args.out_dir, root, args.format, channels, maps=not args.no_maps, png=args.png, names=names)
    weights = dict(checkpoint=args.checkpoint, random=bool(args.random_weights),
                   seed=args.seed if args.random_weights else None)
    warnings = [RANDOM_WEIGHTS_WARNING] if args.random_weights else []
    if ctx.rank == 0:
        for w in warnings:
            print(f"WARNING: {w}", file=sys.stderr, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    check_settings(args, ctx, feature_settings(args, channels))

    state = RankState(ctx.rank, ctx.world_size, paths[ctx.rank :: ctx.world_size])
    pooled = done_pooled = None
    if args.pool:
        pooled = PooledStore(args.out_dir, ctx.rank, ctx.world_size, channels)
        done_pooled = set() if args.overwrite else pooled.load_existing({plan.key(p) for p in state.assigned})
    ctx.barrier()  # every rank has read the old pooled files before any are replaced

    progress = Progress(ctx, len(state.assigned), len(paths), enabled=not args.no_progress)
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _main_thread() else None
    try:
        extract_share(args, extractor, plan, state, pooled, done_pooled, progress)
        progress.follow_others(args.dist_timeout * 60)
    except BaseException as err:
        message = _record_stop(args, ctx, state, pooled, err)
        if isinstance(err, Exception) and not isinstance(err, Terminated):
            raise RankFailed(message) from err
        raise
    finally:
        progress.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    state.status = "complete"
    if pooled is not None:
        shard = pooled.write_shard([plan.key(state.assigned[i]) for i in sorted(state.rows)])
        state.pooled_file = os.path.relpath(shard, args.out_dir).replace(os.sep, "/")
    info = state.to_json()
    atomic_write(state.path(args.out_dir), json.dumps(info, indent=1).encode())
    if ctx.world_size > 1:
        print(f"rank {ctx.rank}: {info['new']} new images in {info['seconds']:.1f} s "
              f"({info['images_per_second']:.2f} img/s), {info['resumed']} already complete, "
              f"{len(info['failed'])} skipped", file=sys.stderr, flush=True)
    gathered = ctx.gather(info)  # waits for every rank
    if ctx.rank != 0 or gathered is None:
        return info

    return _finish_job(args, ctx, gathered, paths, time.perf_counter() - wall_start, weights, warnings)


def _record_stop(args: argparse.Namespace, ctx: DistContext, state: RankState, pooled: Optional[PooledStore],
                 err: BaseException) -> str:
    """A rank stopped by ``err`` (an error, Ctrl-C, SIGTERM): keep its pooled vectors, write its
    record with what is pending, and say so on stderr; the message."""
    state.status = "interrupted" if isinstance(err, (KeyboardInterrupt, Terminated)) else "failed"
    state.error = f"{type(err).__name__}: {err}"
    if pooled is not None:
        pooled.flush()
    info = state.to_json()
    info["traceback"] = traceback.format_exc()
    atomic_write(state.path(args.out_dir), json.dumps(info, indent=1).encode())
    message = (f"rank {ctx.rank} of {ctx.world_size} {state.status}"
               + (f" on {', '.join(state.in_flight)}" if state.in_flight else "")
               + f": {state.error}; {len(info['pending'])} of its {len(state.assigned)} images are not done "
               f"(listed under 'pending' in {state.path(args.out_dir)}); run the same command again to finish them")
    print(message, file=sys.stderr, flush=True)
    return message


def _finish_job(args: argparse.Namespace, ctx: DistContext, gathered: List[dict], paths: List[str], wall: float,
                weights: dict, warnings: List[str]) -> dict:
    """Rank 0, every rank done: the index, older runs' shards and rank records removed, the
    summary printed; the summary."""
    summary = write_index(args, gathered, paths, wall, weights, warnings)
    PooledStore.remove_stale(args.out_dir, ctx.world_size)
    RankState.remove_stale(args.out_dir, ctx.world_size)
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
