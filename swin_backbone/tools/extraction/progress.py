"""The progress bar of a rank (tqdm where installed, else a line every 10 s); rank 0's counts
every rank's images."""
from __future__ import annotations

import sys
import time

from .distributed import DistContext


class Progress:
    """One bar per rank; rank 0's counts every rank's images (through torchrun's store)."""

    def __init__(self, ctx: DistContext, mine: int, total: int, enabled: bool) -> None:
        self.ctx, self.mine, self.total, self.enabled = ctx, mine, total, enabled
        self.done, self.unsent, self.last_sync, self.last_print = 0, 0, 0.0, 0.0
        self.bar = None
        shown_total = total if ctx.rank == 0 else mine
        desc = "extracting" if ctx.world_size == 1 else ("all ranks" if ctx.rank == 0 else f"rank {ctx.rank}")
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=shown_total, unit="img", desc=desc, position=ctx.rank, dynamic_ncols=True)
            except ImportError:  # tqdm is optional: a line every 10 s instead
                self.bar = None
        self.desc, self.shown_total = desc, shown_total

    def update(self, n: int) -> None:
        self.done += n
        self.unsent += n
        now = time.perf_counter()
        if now - self.last_sync < 0.5 and self.done < self.mine:
            return  # the store (and the terminal) hear from this rank at most twice a second
        self.last_sync = now
        job = self.ctx.counter("done", self.unsent)
        self.unsent = 0
        shown = job if (self.ctx.rank == 0 and job is not None) else self.done
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(shown - self.bar.n)
        elif now - self.last_print > 10 or shown == self.shown_total:
            self.last_print = now
            print(f"{self.desc}: {shown}/{self.shown_total} images", file=sys.stderr, flush=True)

    def follow_others(self, timeout_s: float) -> None:
        """Rank 0, its own share done: keep the job-wide bar moving until every rank is done
        (or the store stops answering, or ``timeout_s``; torchrun ends this process if a rank fails)."""
        if self.ctx.rank != 0 or self.ctx.world_size == 1 or not self.enabled:
            return
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            job = self.ctx.counter("done", 0)
            if job is None or job >= self.total:
                break
            if self.bar is not None:
                self.bar.update(job - self.bar.n)
            time.sleep(0.5)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
