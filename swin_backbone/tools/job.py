"""A command-line tool as a rank of a torchrun job: where this process stands, the two
collectives the ranks need (gloo: metadata only, never features), and ending a rank."""
from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import torch.distributed as dist

#: How long a rank whose collective failed (another rank died) waits before failing itself, so
#: that torchrun names the rank that died first as the root cause.
PEER_FAILURE_GRACE_S = 5.0


@dataclass
class DistContext:
    """Where this process stands in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def barrier(self) -> None:
        if self.world_size > 1:
            self._collective(dist.barrier)

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere); waits for all ranks."""
        if self.world_size == 1:
            return [obj]
        out: Optional[List[Any]] = [None] * self.world_size if self.rank == 0 else None
        self._collective(dist.gather_object, obj, out, dst=0)
        return out

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as err:
            time.sleep(PEER_FAILURE_GRACE_S)
            raise RuntimeError(f"rank {self.rank}: another rank stopped before the job finished (see its report); "
                               f"{type(err).__name__}: {err}") from err


def init_distributed(timeout_min: float) -> DistContext:
    """Join the torchrun job described by the environment (gloo), or run alone when there is none."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistContext()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=timeout_min))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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
