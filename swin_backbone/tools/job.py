"""Ending a torchrun rank (the command-line tools under ``torchrun``)."""
from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist


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
