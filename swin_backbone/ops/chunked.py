"""Chunk sizes for CPU work that runs faster a cache-sized piece at a time, and the row-chunked
inference MLP: the ``4C``-wide hidden activations are made a few thousand tokens at a time.

At detection resolution a stage-1 MLP's hidden tensor is ~90 MB per image: computed whole,
it is written by one matmul, read and rewritten by GELU and read again by the next matmul,
each time from main memory (and freshly page-faulted, since allocations that large go
straight to the OS). In chunks of ~8 MB the same work stays in cache: measured ~2x faster
for the MLP on CPU. Used on CPU whenever no activations are kept for backward (inference);
the training path chunks only what it recomputes (see recompute.py), and the attention
backward runs a few windows at a time (attention.py). GPUs run whole tensors: there chunks
would only multiply kernel launches.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

#: Bytes of hidden activations per chunk: well inside a server L3 cache / a few L2 caches.
CHUNK_BYTES = 8 * 2**20

#: Bytes of ``(B, windows, nH, N, N)`` attention logits per chunk of the attention backward
#: (attention.py): its softmax and five small matmuls then share the cache. Measured in a
#: 2 x 512 x 512 training step: stage-1 blocks 72 ms (whole tensors: 102 ms); smaller chunks
#: lose to per-call overhead in the later stages (whose maps are one or two chunks anyway).
ATTENTION_CHUNK_BYTES = 4 * 2**20

#: Bytes of map rows per chunk of :func:`norm_nchw`'s transposing copy.
TRANSPOSE_CHUNK_BYTES = 2**20


def grad_needed(*tensors: torch.Tensor) -> bool:
    """Whether autograd records ops on these tensors (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def chunk_rows(width: int, itemsize: int, budget: Optional[int] = None) -> int:
    """Rows per chunk so that a ``(rows, width)`` tensor takes about ``budget`` bytes
    (default :data:`CHUNK_BYTES`)."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // (width * itemsize))


def chunk_slices(total: int, step: int) -> List[slice]:
    """Slices covering ``range(total)`` in chunks of at most ``step``, as even as possible
    (2048 rows by 1365 would leave a 683-row tail, whose matmuls run at a lower rate)."""
    count = max(1, -(-total // max(step, 1)))
    base, extra = divmod(total, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def mlp_residual_(x: torch.Tensor, norm: nn.Module, fc1: nn.Linear, fc2: nn.Linear) -> torch.Tensor:
    """``x += fc2(gelu(fc1(norm(x))))`` in row chunks, in place, without autograd.

    The residual goes into ``x`` (which the caller owns) instead of a new map-sized tensor:
    an allocation that large comes from the OS page by page, and the add ran ~2x slower.

    Args:
        x: ``(..., C)`` contiguous tokens, modified in place.
    Returns:
        ``x``.
    """
    rows = x.view(-1, x.shape[-1])
    for part in chunk_slices(rows.shape[0], chunk_rows(fc1.out_features, x.element_size())):
        chunk = rows[part]
        chunk.add_(fc2(F.gelu(fc1(norm(chunk)))))
    return x


def norm_nchw(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``norm(x)`` for a ``(B, H, W, C)`` map, returned as a contiguous ``(B, C, H, W)``.

    Without autograd on CPU the transposing copy runs a few rows of the map at a time: whole,
    its strided writes miss the cache (stage 1 at 800 x 1216: 54 ms; by rows: 11 ms).
    """
    if x.device.type != "cpu" or torch.compiler.is_compiling() or grad_needed(x, *norm.parameters()):
        return norm(x).permute(0, 3, 1, 2).contiguous()
    batch, height, width, channels = x.shape
    out = None
    # (chunk_slices yields at least one slice, also for an empty map.)
    for rows in chunk_slices(height, chunk_rows(width * channels, x.element_size(), TRANSPOSE_CHUNK_BYTES)):
        part = norm(x[:, rows]).permute(0, 3, 1, 2)
        if out is None:  # dtype known only now (autocast)
            out = part.new_empty(batch, channels, height, width)
        out[:, :, rows] = part
    return out
