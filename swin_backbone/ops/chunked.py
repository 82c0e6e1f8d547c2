"""CPU work that runs faster a cache-sized piece at a time: the row-chunked inference MLP
and the output LayerNorm + NCHW transpose by map rows.

At detection resolution a stage-1 MLP's hidden tensor is far larger than any cache: computed whole,
it is written by one matmul, read and rewritten by GELU and read again by the next matmul,
each time from main memory (and freshly page-faulted, since allocations that large go
straight to the OS). In chunks of a few MB the same work stays in cache. The planner sets
the chunk size (:func:`~swin_backbone.ops.planner.cpu_chunk_bytes`); the training path
chunks only what it recomputes (recompute.py) and the attention backward (attention.py).
GPUs run whole tensors: there chunks would only multiply kernel launches.
"""
from __future__ import annotations

from typing import Callable, List

import torch
from torch import nn


def chunk_rows(width: int, itemsize: int, budget: int) -> int:
    """Rows per chunk so that a ``(rows, width)`` tensor takes about ``budget`` bytes."""
    return max(1, budget // (width * itemsize))


def chunk_slices(total: int, step: int) -> List[slice]:
    """Slices covering ``range(total)`` in chunks of at most ``step``, as even as possible
    (2048 rows by 1365 would leave a 683-row tail, whose matmuls run at a lower rate)."""
    count = max(1, -(-total // max(step, 1)))
    base, extra = divmod(total, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def add_by_rows_(x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor], hidden: int,
                 chunk_bytes: int) -> torch.Tensor:
    """``x += branch(x)`` for ``(..., C)`` contiguous tokens ``x``, a row chunk at a time
    (chunks sized for ``hidden`` channels), in place, without autograd: the inference MLP
    residual. Into ``x`` (which the caller owns) instead of a new map-sized tensor: an
    allocation that large comes from the OS page by page, which makes the add slower."""
    rows = x.view(-1, x.shape[-1])
    for part in chunk_slices(rows.shape[0], chunk_rows(hidden, x.element_size(), chunk_bytes)):
        chunk = rows[part]
        chunk.add_(branch(chunk))
    return x


def norm_nchw_by_rows(x: torch.Tensor, norm: nn.Module, chunk_bytes: int) -> torch.Tensor:
    """``norm(x)`` for a ``(B, H, W, C)`` map, returned as a contiguous ``(B, C, H, W)``,
    without autograd, a few map rows (``chunk_bytes / 8``) at a time: whole, the transposing
    copy's strided writes miss the cache."""
    batch, height, width, channels = x.shape
    out = None
    # (chunk_slices yields at least one slice, also for an empty map.)
    for rows in chunk_slices(height, chunk_rows(width * channels, x.element_size(), chunk_bytes // 8)):
        part = norm(x[:, rows]).permute(0, 3, 1, 2)
        if out is None:  # dtype known only now (autocast)
            out = part.new_empty(batch, channels, height, width)
        out[:, :, rows] = part
    return out
