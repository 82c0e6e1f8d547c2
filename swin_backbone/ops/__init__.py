"""How Swin is computed: the functional interface the model modules call.

Each function takes the :class:`~swin_backbone.ops.planner.Plan` decided once per forward by
:func:`plan_forward` and runs the implementation it names; nothing here or in the model asks
about devices or grad modes again. The implementations live in the submodules (docs/design.md
lists them, one line each).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import recompute as _recompute
from .attention import project  # a tensor of its own, not a view: residuals are added into it in place
from .attention import window_attention
from .chunked import add_by_rows_, norm_nchw_by_rows
from .cosine import continuous_position_bias, cosine_qkv  # Swin V2's logits for the same kernels
from .image_sizes import merge_2x2, straddles, zero_beyond_valid, zero_straddles_
from .kernel_choice import resolve_attention as check_attention
from .layouts import WindowLayout, clear_caches, window_partition
from .planner import Plan, override, plan_for, plan_for_module, plan_forward
from .recompute import mlp_branch
from .stage import AttentionInputs, finish_forward, plan_stage, stage_layouts

__all__ = [
    "AttentionInputs", "Plan", "check_attention", "clear_caches", "continuous_position_bias", "cosine_qkv",
    "finish_forward", "mask_input", "merge_patches", "mlp_residual", "norm_linear", "norm_qkv", "output_nchw",
    "override", "plan_for", "plan_for_module", "plan_forward", "plan_stage", "project", "stage_layouts",
    "window_attention",
]


def norm_linear(x: torch.Tensor, norm: nn.Module, linear: nn.Linear, plan: Plan) -> torch.Tensor:
    """``linear(norm(x))``, ``(..., C)`` -> ``(..., C_out)``."""
    if plan.save_memory:
        return _recompute.norm_linear(x, norm, linear.weight, linear.bias)
    return linear(norm(x))


def norm_qkv(x: torch.Tensor, norm: Optional[nn.Module], weight: torch.Tensor, bias: Optional[torch.Tensor],
             layout: WindowLayout, plan: Plan) -> torch.Tensor:
    """LayerNorm (``None``: none, Swin V2), (shifted) window partition and qkv projection
    ``F.linear(.., weight, bias)`` of ``(B, H * W, C)`` tokens.

    Returns ``(B, nW * N, 3C)`` in ``layout``'s window order, or ``(B, H * W, 3C)`` row-major
    tokens for the fused Triton kernel (which gathers its windows itself).
    """
    windows = None if plan.attention == "triton" else layout
    if norm is not None and plan.save_memory:
        return _recompute.norm_linear(x, norm, weight, bias, windows)
    x = x if norm is None else norm(x)
    return F.linear(x if windows is None else window_partition(x, windows), weight, bias)


def mlp_residual(x: torch.Tensor, mlp: nn.Module, norm: nn.Module, norm_first: bool, drop_path: nn.Module,
                 plan: Plan) -> torch.Tensor:
    """The MLP residual of ``(B, L, C)`` tokens that the caller owns: ``x + drop_path(mlp(norm(x)))``
    with the norm first (Swin V1), ``x + drop_path(norm(mlp(x)))`` with it after (Swin V2).

    ``mlp`` has ``fc1``, ``act`` (GELU), ``fc2`` and ``drop``. CPU inference adds into ``x``
    in place, a row chunk at a time; training keeps only the inputs for backward
    (:func:`~.recompute.mlp`).
    """
    if plan.chunk_bytes and not plan.grad and not plan.stochastic:
        return add_by_rows_(x, lambda rows: mlp_branch(rows, mlp, norm, norm_first), mlp.fc1.out_features,
                            plan.chunk_bytes)
    if plan.save_memory and not plan.dropout:
        return drop_path(_recompute.mlp(x, mlp.fc1, mlp.fc2, norm, norm_first, plan.chunk_bytes)).add_(x)
    return drop_path(mlp_branch(x, mlp, norm, norm_first)).add_(x)


def output_nchw(x: torch.Tensor, norm: nn.Module, channels_last: bool, plan: Plan) -> torch.Tensor:
    """``norm(x)`` of a ``(B, H, W, C)`` map as ``(B, C, H, W)``: a view of channels-last
    memory if ``channels_last``, else contiguous NCHW (by map rows in CPU inference).
    With the plan's ``valid_sizes``, zeros beyond each image's valid size."""
    if channels_last:
        out = norm(x).permute(0, 3, 1, 2)
    elif plan.chunk_bytes and not plan.grad:
        out = norm_nchw_by_rows(x, norm, plan.chunk_bytes)
    else:
        out = norm(x).permute(0, 3, 1, 2).contiguous()
    if plan.valid_sizes is None:
        return out
    return zero_beyond_valid(out, plan.valid_sizes, 2, inplace=not plan.grad)


def mask_input(x: torch.Tensor, plan: Plan, patch_size: int) -> torch.Tensor:
    """``(B, C, H, W)`` input as the patch embedding reads it with the plan's per-image
    ``valid_sizes`` (pixels): zeros beyond an image where a patch straddles its edge, as alone
    (patches wholly beyond an image only feed tokens the image never reads). The caller's
    tensor is never written: a copy where something must be zeroed (all of the region beyond
    the images where ``x`` requires grad, so that no gradient leaves them); ``x`` itself
    where nothing must (no straddling patch, or zeros there already)."""
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
    """Patch merging's gather: each 2x2 cell of a ``(B, H, W, C)`` map concatenated,
    ``(B, ceil(H / 2), ceil(W / 2), 4C)``, reading zeros beyond each image of the plan's
    ``valid_sizes`` where a cell straddles its edge (:func:`~.windows.merge_2x2`)."""
    return merge_2x2(x, plan.valid_sizes)
