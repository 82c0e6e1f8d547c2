"""Swin V2's attention logits as inputs of the ordinary window attention.

Swin V2 (Liu et al. 2022) replaces V1's ``q k^T * head_dim**-0.5 + table bias`` by

    ``cos(q, k) * exp(min(logit_scale, log 100)) + 16 * sigmoid(cpb_mlp(log-spaced coords))``.

Both parts fit the V1 kernels unchanged (SDPA, plain, CPU recompute, the fused Triton one):

* :func:`cosine_qkv` normalises q and k per head and multiplies q by the per-head logit
  scale, so that the dot product of the prepared q and k *is* the scaled cosine; the window
  attention then runs with ``scale=1.0``. Normalisation is per token, so it commutes with the
  window partition: it applies to window-ordered and row-major ``qkv`` alike.
* :func:`continuous_position_bias` evaluates the CPB MLP once over the table of log-spaced
  relative coordinates (:func:`log_spaced_coords`, cached like the window layouts);
  ``16 * sigmoid`` is elementwise, so applying it before the gather gives the table that
  :func:`swin_backbone.ops.window_attention` gathers as V1's learned one.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .planner import Plan
from .layouts import size_cache

#: Upper clamp of ``logit_scale`` (the official ``log(1 / 0.01)``), a Python float so that
#: the clamp works on every device (the official code builds a CPU tensor here).
LOGIT_SCALE_MAX = math.log(100.0)

#: Coordinates are normalised to ``[-COORD_RANGE, COORD_RANGE]`` before the log spacing.
COORD_RANGE = 8.0

#: ``F.normalize``'s default epsilon: q and k are divided by ``max(|q|, eps)``.
NORMALIZE_EPS = 1e-12

#: Output scale of the position bias: ``16 * sigmoid(...)`` lies in ``(0, 16)``.
BIAS_SCALE = 16.0


def log_spaced_coords(table_window: int, pretrained_window: int) -> torch.Tensor:
    """Log-spaced relative coordinates of a ``table_window`` window, ``((2 tw - 1)**2, 2)`` fp32.

    Row ``r = (dy + tw - 1) * (2 tw - 1) + (dx + tw - 1)`` holds ``(f(dy), f(dx))`` with
    ``f(d) = sign(d) * log2(1 + 8 |d| / (n - 1)) / log2(8)``, where ``n`` is
    ``pretrained_window`` if it is > 0 (a fine-tune of a model pre-trained with that
    window), else ``table_window``. Rows are in the order of
    :func:`~swin_backbone.ops.windows.relative_position_index` (the table gathers like V1's).
    A 1-wide window (``n = 1``) has only the offset 0, which maps to 0.
    """
    if table_window < 1:
        raise ValueError(f"table_window: expected an int >= 1, got {table_window!r}")
    if pretrained_window < 0:
        raise ValueError(f"pretrained_window: expected an int >= 0, got {pretrained_window!r}")
    n = pretrained_window if pretrained_window > 0 else table_window
    offsets = torch.arange(-(table_window - 1), table_window, dtype=torch.float32)
    offsets = offsets / max(n - 1, 1) * COORD_RANGE
    offsets = torch.sign(offsets) * torch.log2(offsets.abs() + 1.0) / math.log2(COORD_RANGE)
    dy, dx = torch.meshgrid(offsets, offsets, indexing="ij")
    return torch.stack((dy.reshape(-1), dx.reshape(-1)), dim=1)


def _coords_on(table_window: int, pretrained_window: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return log_spaced_coords(table_window, pretrained_window).to(device=device, dtype=dtype)


#: Cached :func:`log_spaced_coords` on a device, in a dtype (the CPB MLP's).
get_log_spaced_coords = size_cache(maxsize=64)(_coords_on)


def continuous_position_bias(cpb_mlp: nn.Module, table_window: int, pretrained_window: int) -> torch.Tensor:
    """``16 * sigmoid(cpb_mlp(coords))``: the ``((2 tw - 1)**2, nH)`` bias table of a window.

    ``cpb_mlp`` maps ``(..., 2)`` coordinates to ``(..., nH)``; the table is in the MLP's
    output dtype (the autocast dtype under autocast) and differentiable w.r.t. its weights.
    """
    weight = cpb_mlp[0].weight  # (not parameters(): FSDP sets plain tensors while it recomputes a unit)
    coords = get_log_spaced_coords(table_window, pretrained_window, weight.device, weight.dtype)
    return torch.sigmoid(cpb_mlp(coords)).mul(BIAS_SCALE)


def cosine_qkv(qkv: torch.Tensor, logit_scale: torch.Tensor, num_heads: int,
               plan: Optional[Plan] = None) -> torch.Tensor:
    """``(..., 3C)`` projected tokens (q / k / v each ``num_heads`` heads, any token order) ->
    ``[normalize(q) * exp(min(logit_scale, log 100)), normalize(k), v]`` per head, in ``qkv``'s
    dtype, the same values bit for bit on every path; ``logit_scale``: ``(nH, 1, 1)`` (or ``nH``
    elements). With a ``plan``, ``qkv`` is a tensor the caller owns, overwritten where nothing
    records a gradient (``None``: plain autograd ops on a new tensor).

    q and k are normalised in fp32 (fp64 for fp64) whatever the compute dtype: in fp16 the squared norm of a
    head can overflow, and ``F.normalize``'s epsilon (1e-12) underflows to 0, which would turn
    an all-zero key (a padding token: the qkv projection of a zero token has a zero k bias)
    into ``0 / 0``. In fp32 a zero key stays zero and its logits are exactly 0.

    fp32 / fp64 need no normalised copy: the division by the norms (``F.normalize``'s
    ``q / max(|q|, eps)``) and the multiplication by the scale run on ``qkv`` itself where
    nothing records a gradient, else on one new tensor (v divided by 1: unchanged), which the
    memory-saving path (``plan.save_memory``: :class:`_CosineQKV`) keeps as the only tensor for
    backward: the attention kernels keep it anyway.
    """
    *lead, width = qkv.shape
    channels = width // 3
    heads = qkv.reshape(*lead, 3, num_heads, channels // num_heads)
    acc = torch.promote_types(qkv.dtype, torch.float32)  # fp16 / bf16 -> fp32; fp64 stays
    scale = torch.clamp(logit_scale.reshape(num_heads, 1).to(acc), max=LOGIT_SCALE_MAX).exp()
    if acc != qkv.dtype:
        qk = F.normalize(heads[..., :2, :, :].to(acc), dim=-1)
        q = qk[..., 0, :, :] * scale
        k = qk[..., 1, :, :]
        v = heads[..., 2, :, :]
        return torch.stack((q.to(qkv.dtype), k.to(qkv.dtype), v), dim=-3).reshape(qkv.shape)
    if plan is not None and not plan.grad and not plan.tracing:
        with torch.no_grad():
            return _normalize_and_scale(heads, scale, inplace=True)[0].reshape(qkv.shape)
    if plan is not None and plan.save_memory:
        return _CosineQKV.apply(heads, scale).reshape(qkv.shape)
    return _normalize_and_scale(heads, scale, inplace=False)[0].reshape(qkv.shape)


def _normalize_and_scale(heads: torch.Tensor, scale: torch.Tensor, inplace: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(..., 3, nH, d)`` heads -> ``[q / |q| * scale, k / |k|, v]`` (norms clamped at
    :data:`NORMALIZE_EPS`), in ``heads`` itself or in one new tensor; and the clamped norms
    ``(..., 2, nH, 1)``."""
    norms = torch.linalg.vector_norm(heads[..., :2, :, :], dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)
    if inplace:
        heads[..., :2, :, :].div_(norms)
        out = heads
    else:
        ones = norms.new_ones(()).expand(*norms.shape[:-3], 1, norms.shape[-2], 1)
        out = heads / torch.cat((norms, ones), dim=-3)
    out[..., 0, :, :].mul_(scale)
    return out, norms


class _CosineQKV(torch.autograd.Function):
    """:func:`cosine_qkv` in fp32 / fp64 that keeps its output (which the attention keeps
    anyway), the norms and the scale for backward, instead of autograd's input and normalised
    copies.

    With ``y = x / n`` (``n = max(|x|, eps)``) and the output ``o = a y`` (``a``: the scale
    for q, 1 for k), the gradient of ``x`` is ``(a g - o <g, o> [|x| > eps] / a) / n`` per
    head and token (``F.normalize``'s, written with ``o``), and that of the scale
    ``sum <g_q, o_q> / a``; v passes its gradient through.
    """

    @staticmethod
    def forward(ctx, heads, scale):
        out, norms = _normalize_and_scale(heads, scale, inplace=False)
        ctx.save_for_backward(out, norms, scale)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, norms, scale = ctx.saved_tensors
        grad_qk, out_qk = grad[..., :2, :, :], out[..., :2, :, :]
        a = torch.stack((scale, torch.ones_like(scale)))  # (2, nH, 1): q's scale, k's 1
        dot = (grad_qk * out_qk).sum(-1, keepdim=True)  # <g, o> per token, q / k and head
        unclamped = norms > NORMALIZE_EPS  # (clamp_min passes no gradient to the norm at eps)
        grad_heads = torch.empty_like(grad)
        torch.mul(grad_qk, a / norms, out=grad_heads[..., :2, :, :])
        grad_heads[..., :2, :, :].addcmul_(out_qk, dot * unclamped / (a * norms), value=-1)
        grad_heads[..., 2, :, :] = grad[..., 2, :, :]
        grad_scale = None
        if ctx.needs_input_grad[1]:
            grad_scale = dot[..., 0, :, :].reshape(-1, scale.shape[0]).sum(0).unsqueeze(-1) / scale
        return grad_heads, grad_scale
