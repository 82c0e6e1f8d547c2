"""Where a process stands in a torchrun job, and the few collectives the ranks need (gloo: the
ranks exchange metadata, never features)."""
from __future__ import annotations

import datetime
import os
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
