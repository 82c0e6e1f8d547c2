"""One rank's share of the images: decode in workers, batch, run the backbone, write, and record
what was done (``ranks/rank-RRRRR-of-WWWWW.json``)."""
from __future__ import annotations

import argparse
import os
import re
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from torch.utils.data import DataLoader

from ...features import FeatureExtractor, mean_pool
from .loading import ImageJobs, as_is
from .outputs import OutputPlan
from .pooled import PooledStore
from .progress import Progress

RANKS_DIR = "ranks"


@dataclass
class RankState:
    """What one rank did: written to ``ranks/rank-RRRRR-of-WWWWW.json`` when it stops, whatever the reason."""

    rank: int
    world_size: int
    assigned: List[str]
    status: str = "running"
    error: Optional[str] = None
    new: int = 0
    resumed: int = 0
    seconds: float = 0.0
    rows: Dict[int, List[dict]] = field(default_factory=dict)  # image index -> rows
    failed: Dict[int, str] = field(default_factory=dict)  # image index -> error
    notes: List[str] = field(default_factory=list)  # images read, but with a remark (a cut-off JPEG)
    in_flight: List[str] = field(default_factory=list)
    pooled_file: Optional[str] = None

    def to_json(self) -> dict:
        done = sorted(self.rows)
        finished = set(done) | set(self.failed)
        return dict(rank=self.rank, world_size=self.world_size, status=self.status, error=self.error,
                    assigned=len(self.assigned), images=len(done), new=self.new, resumed=self.resumed,
                    seconds=round(self.seconds, 3), images_per_second=round(self.new / max(self.seconds, 1e-9), 3),
                    failed=[dict(image=self.assigned[i], error=e) for i, e in sorted(self.failed.items())],
                    in_flight=self.in_flight, pending=[p for i, p in enumerate(self.assigned) if i not in finished],
                    pooled_file=self.pooled_file, notes=self.notes, features=[r for i in done for r in self.rows[i]])

    def path(self, out_dir: str) -> str:
        return os.path.join(out_dir, RANKS_DIR, f"rank-{self.rank:05d}-of-{self.world_size:05d}.json")

    @staticmethod
    def remove_stale(out_dir: str, world_size: int) -> None:
        """Rank 0, after every rank wrote its record: delete the records of runs with another world size."""
        ranks_dir = os.path.join(out_dir, RANKS_DIR)
        for name in os.listdir(ranks_dir):
            if re.fullmatch(r"rank-\d{5}-of-\d{5}\.json", name) and not name.endswith(f"-of-{world_size:05d}.json"):
                os.remove(os.path.join(ranks_dir, name))


class _InlineExecutor:
    """``ThreadPoolExecutor``'s ``submit`` without threads: runs the call now."""

    def __enter__(self) -> "_InlineExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as err:
            fut.set_exception(err)
        return fut


def extract_share(args: argparse.Namespace, extractor: FeatureExtractor, plan: OutputPlan, state: RankState,
                  pooled: Optional[PooledStore], done_pooled: Optional[Set[str]], progress: Progress) -> None:
    """The rank's loop: workers decode, images are batched (mixed sizes where the backbone takes
    per-image valid sizes, else by size), a writer thread writes."""
    cuda = extractor.device.type == "cuda"
    jobs = ImageJobs(state.assigned, plan, tuple(args.resize) if args.resize else None,
                     skip_complete=not args.overwrite, pooled=done_pooled, reader=args.reader, loader=args.loader)
    loader = DataLoader(jobs, batch_size=None, shuffle=False, num_workers=args.workers, collate_fn=as_is,
                        pin_memory=cuda, prefetch_factor=max(2, args.batch_size) if args.workers else None)
    buckets: "OrderedDict[Optional[Tuple[int, int]], List[dict]]" = OrderedDict()
    max_held = 8 * args.batch_size  # decoded images waiting for same-size partners, at most
    writes: Deque[Tuple[int, Future]] = deque()

    def reap(keep: int) -> None:
        while writes and (len(writes) > keep or writes[0][1].done()):
            i, fut = writes.popleft()
            try:
                state.rows[i] = fut.result()
            except Exception as err:
                state.in_flight = [state.assigned[i]]  # the image the failure is about
                raise RuntimeError(f"writing its outputs: {type(err).__name__}: {err}") from err
            state.new += 1
            progress.update(1)

    def run(batch: List[dict]) -> None:
        state.in_flight = [state.assigned[it["i"]] for it in batch]
        feats = extractor.run_batch([it["image"] for it in batch])
        for it, feat in zip(batch, feats):
            path = state.assigned[it["i"]]
            if pooled is not None:
                pooled.add(plan.key(path), mean_pool(feat))
            writes.append((it["i"], writer.submit(plan.write, path, feat, it["shown"])))
        reap(keep=2 * args.batch_size)

    start = time.perf_counter()
    # On CUDA two threads write while the GPU computes; on the CPU the forward already uses
    # every core, and extra threads there stall its OpenMP regions, so writes happen inline.
    with (ThreadPoolExecutor(max_workers=2, thread_name_prefix="write") if cuda else _InlineExecutor()) as writer:
        try:
            for item in loader:
                if item["status"] == "done":
                    state.rows[item["i"]] = item["rows"]
                    state.resumed += 1
                    progress.update(1)
                elif item["status"] == "failed":
                    state.failed[item["i"]] = item["error"]
                    progress.update(1)
                else:
                    if item.get("note"):
                        state.notes.append(item["note"])
                    # One bucket where the backbone batches mixed sizes exactly, else one per size.
                    size = None if extractor.mixed_sizes else tuple(item["image"].shape[-2:])
                    buckets.setdefault(size, []).append(item)
                    if len(buckets[size]) >= args.batch_size:
                        run(buckets.pop(size))
                    elif sum(map(len, buckets.values())) >= max_held:
                        run(buckets.pop(next(iter(buckets))))  # the oldest size waits no longer
            while buckets:
                run(buckets.pop(next(iter(buckets))))
            reap(keep=0)
        finally:
            state.seconds = time.perf_counter() - start
            for _, fut in writes:
                fut.cancel()
    state.in_flight = []
