"""A command-line tool as a rank of a torchrun job: where this process stands, the few
collectives the ranks need (gloo: the ranks exchange metadata, never features), the job-wide
progress bar, and ending a rank."""
from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import torch.distributed as dist

#: How long a rank that saw another rank die waits before failing itself (torchrun names the
#: first process to exit as the root cause).
PEER_FAILURE_GRACE_S = 5.0


@dataclass
class DistContext:
    """Where this process stands in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    initialized: bool = False

    def barrier(self) -> None:
        if self.initialized:
            self._collective(dist.barrier)


    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere); waits for all ranks."""
        if not self.initialized:
            return [obj]
        out: Optional[List[Any]] = [None] * self.world_size if self.rank == 0 else None
        self._collective(dist.gather_object, obj, out, dst=0)
        return out

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as err:
            # Another rank died. Stay alive a moment so that torchrun sees that rank fail
            # first (and names it as the root cause), then stops this one.
            time.sleep(PEER_FAILURE_GRACE_S)
            raise RuntimeError(f"rank {self.rank}: another rank stopped before the job finished "
                               f"(see its report); {type(err).__name__}: {err}") from err

    def counter(self, name: str, add: int) -> Optional[int]:
        """Add to a job-wide counter in torchrun's key-value store (no sync between ranks)."""
        if not self.initialized:
            return None
        try:
            return dist.distributed_c10d._get_default_store().add(f"extract_features/{name}", add)
        except Exception:
            return None


def init_distributed(timeout_min: float) -> DistContext:
    """Join the torchrun job described by the environment (gloo: the ranks only exchange
    metadata, never features), or run alone when there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=timeout_min))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), initialized=True)


def in_job() -> bool:
    """Whether this process belongs to an initialised process group (a torchrun rank)."""
    return dist.is_available() and dist.is_initialized()


def leave_job(code: int) -> None:
    """In a torchrun rank, end the process with ``code`` without Python's teardown; elsewhere
    return.

    The gloo process group's destructor joins its worker threads while holding the GIL (until
    pytorch#154976, 2025: torch 2.0 and 2.1 have it), and a worker that frees the last finished
    collective (whose tensors have Python objects) waits for the GIL: the rank hangs at exit, at
    random (pytorch#56297), with or without ``destroy_process_group()``. A group left to
    interpreter shutdown instead can abort the rank ("terminate called without an active
    exception", seen after a finished mmengine training run on torch 2.14). Callers have written
    and closed every output, so the rank flushes what it printed and leaves.
    """
    if not in_job():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------- progress
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
