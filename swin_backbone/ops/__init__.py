"""How Swin is computed: the functional interface the model modules call, each function
running what the :class:`~swin_backbone.ops.planner.Plan` of the forward names (docs/design.md).
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import KERNELS, window_attention, window_partition
from .cosine import continuous_position_bias, cosine_qkv  # Swin V2's logits for the same kernels
from .image_sizes import merge_2x2, straddles, zero_beyond_valid, zero_straddles_
from .layouts import WindowLayout, clear_caches
from .planner import (
    PLAIN_SWIN_MODULES, Plan, override, plan_for, plan_forward, plan_stage,
    resolve_attention as check_attention,
)
from .regions import checkpointed, mlp_residual, row_chunks

__all__ = [
    "KERNELS", "PLAIN_SWIN_MODULES", "Plan", "WindowLayout", "check_attention", "checkpointed", "clear_caches",
    "continuous_position_bias", "cosine_qkv", "mask_input", "merge_patches", "mlp_residual", "output_nchw", "override",
    "plan_for", "plan_forward", "plan_stage", "row_chunks", "window_attention", "window_partition",
]


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


def mask_input(x: torch.Tensor, plan: Plan, patch_size: int) -> torch.Tensor:
    """``(B, C, H, W)`` input with zeros beyond an image where a patch straddles its edge (all
    beyond it if ``x`` requires grad); a copy where anything must be zeroed, else ``x`` itself."""
    if plan.valid_sizes is None:
        return x
    if x.requires_grad:
        return zero_beyond_valid(x, plan.valid_sizes, 2, inplace=False)
    boxes = straddles(plan.valid_sizes, x.shape[2], x.shape[3], patch_size)
    # Batches padded with zeros (mmdet's and mmseg's preprocessors) need no copy; the check
    # reads only the boxes (on CUDA it would wait for the device: copy there instead).
    if not boxes or (plan.device == "cpu" and not any(x[b, :, r0:r1, c0:c1].any() for b, r0, r1, c0, c1 in boxes)):
        return x
    return zero_straddles_(x.clone(), plan.valid_sizes, 2, patch_size)


def merge_patches(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Patch merging's gather (:func:`~.image_sizes.merge_2x2`): ``(B, ceil(H / 2), ceil(W / 2), 4C)``."""
    return merge_2x2(x, plan.valid_sizes)
