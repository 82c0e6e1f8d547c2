"""How a region of the model's modules runs: in one call, by cache-sized row chunks (CPU
inference) or under selective activation checkpointing (training), as the plan says; the
output norms' NCHW maps (:func:`output_nchw`).

The model hands its own methods here (``qkv_windows``, ``mlp_branch``), so that these
mechanics wrap a region of modules without an ``if`` in the model (docs/design.md).
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from .image_sizes import zero_beyond_valid
from .plan import Plan

#: Operators whose outputs selective checkpointing keeps (matmuls: their recomputation costs).
SAVED_OPS = [torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default]

#: Torch's selective activation checkpointing (torch >= 2.4), else ``None``.
_SAC = getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None)
SAVE_MATMULS = None if _SAC is None else functools.partial(_SAC, SAVED_OPS)


def row_chunks(total: int, row_bytes: int, budget: int) -> List[slice]:
    """``range(total)`` in ``ceil(total * row_bytes / budget)`` slices (``budget`` 0: one; at least
    a row each, and one slice also for ``total`` 0), as even as possible (a short tail's matmuls
    run at a lower rate): each within ``budget`` bytes of ``row_bytes`` rows, or one row over it."""
    count = 1 if budget <= 0 else min(max(total, 1), max(1, -(-total * row_bytes // budget)))
    slices = []
    for i in range(count):
        slices.append(slice(i * total // count, (i + 1) * total // count))
    return slices


def checkpointed(fn: Callable[..., torch.Tensor], plan: Plan, *args) -> torch.Tensor:
    """``fn(*args, plan)``, with :attr:`Plan.save_memory` under selective checkpointing (matmul
    outputs kept)."""
    if plan.save_memory:
        return torch_checkpoint.checkpoint(fn, *args, plan, use_reentrant=False, context_fn=SAVE_MATMULS)
    return fn(*args, plan)


def drop_samples(drop_path: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 image_tokens: Optional[Tuple[int, ...]]) -> torch.Tensor:
    """``drop_path(x)`` by sample: ``(B, L, C)`` in one call (``image_tokens`` ``None``); a packed
    layout's ``(1, T, C)`` image by image (its :attr:`~.layouts.WindowLayout.image_tokens`), each
    ``(1, T_b, C)`` as it is alone, so stochastic depth drops each image's branch on its own."""
    # Per image only where it can drop: an nn.Identity or a module in eval mode returns its input.
    if image_tokens is None or isinstance(drop_path, nn.Identity) or not getattr(drop_path, "training", True):
        return drop_path(x)
    images = x.split(image_tokens, dim=1)
    dropped = [drop_path(image) for image in images]
    return x if all(d is i for d, i in zip(dropped, images)) else torch.cat(dropped, 1)


def mlp_residual(x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor],
                 drop_path: Callable[[torch.Tensor], torch.Tensor], image_tokens: Optional[Tuple[int, ...]],
                 hidden: int, plan: Plan) -> torch.Tensor:
    """``x + drop_path(branch(x))`` for caller-owned ``(B, L, C)`` ``x``, a row-wise ``branch``
    (``hidden``: its widest width) and a per-sample ``drop_path`` (:func:`drop_samples`, by
    ``image_tokens``): by cache-sized row chunks into ``x`` with :attr:`Plan.chunked` (where its
    rows exceed one), under selective checkpointing with :attr:`Plan.save_memory`, else one call."""
    # As rows: nn.Linear returns its own 2-d result, no view of it, so the in-place add below
    # records no CopySlices (whose backward zero-fills and copies a map-sized gradient).
    rows = x.reshape(-1, x.shape[-1])
    row_bytes = hidden * x.element_size()
    if plan.chunked and rows.shape[0] * row_bytes > plan.chunk_bytes:  # (more than one chunk)
        # (chunked plans hold no active stochastic module: drop_path returns its input)
        for part in row_chunks(rows.shape[0], row_bytes, plan.chunk_bytes):
            chunk = rows[part]
            chunk.add_(drop_path(branch(chunk)))
        return x
    if plan.save_memory:
        y = torch_checkpoint.checkpoint(branch, rows, use_reentrant=False, context_fn=SAVE_MATMULS)
    else:
        y = branch(rows)
    # Stochastic depth drops whole samples: drop_path sees (B, L, C), never rows.
    samples = y.view(x.shape)
    dropped = drop_samples(drop_path, samples, image_tokens)
    if dropped is samples:  # (inactive: nothing dropped, add as rows)
        return (y.add_(rows) if plan.may_write_module_outputs else rows + y).view(x.shape)
    return dropped.add_(x) if plan.may_write_module_outputs else x + dropped


def output_nchw(x: torch.Tensor, norm: nn.Module, channels_last: bool, plan: Plan) -> torch.Tensor:
    """``norm(x)`` of a ``(B, H, W, C)`` map as ``(B, C, H, W)`` (a channels-last view or
    contiguous), zeros beyond each image's valid size."""
    if channels_last:
        out, own = norm(x).permute(0, 3, 1, 2), None  # a view of the module's output
    elif plan.chunked:  # (by map rows: whole, the transposing copy's strided writes miss the cache)
        batch, height, width, channels = x.shape
        out = None
        for rows in row_chunks(height, width * channels * x.element_size(), plan.chunk_bytes // 8):
            part = norm(x[:, rows]).permute(0, 3, 1, 2)
            if out is None:  # dtype known only now (autocast)
                out = part.new_empty(batch, channels, height, width)
            out[:, :, rows] = part
        own = out
    else:
        view = norm(x).permute(0, 3, 1, 2)
        out = view.contiguous()
        own = None if out is view else out  # (a 1 x 1 map is contiguous already: no copy made)
    if plan.valid_sizes is None:
        return out
    # Zeroed in place only in memory of our own, or where module outputs may be written.
    inplace = not plan.grad and (own is not None or plan.may_write_module_outputs)
    return zero_beyond_valid(out, plan.valid_sizes, 2, inplace=inplace)
