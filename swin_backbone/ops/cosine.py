"""Swin V2's attention logits as inputs of the V1 window-attention kernels (Liu et al. 2022):
``cos(q, k) * exp(min(logit_scale, log 100)) + 16 * sigmoid(cpb_mlp(log-spaced coords))``.

:func:`cosine_qkv` prepares q and k so that their dot product is the scaled cosine (attention
then runs with ``scale=1.0``); :func:`continuous_position_bias` gives a table gathered as V1's.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .layouts import size_cache
from .plan import Plan

#: Upper clamp of ``logit_scale`` (official ``log(1 / 0.01)``), a float: works on every device.
LOGIT_SCALE_MAX = math.log(100.0)

COORD_RANGE = 8.0  #: coordinates are normalised to ``[-8, 8]`` before the log spacing
NORMALIZE_EPS = 1e-12  #: ``F.normalize``'s default: q and k are divided by ``max(|q|, eps)``
BIAS_SCALE = 16.0  #: the position bias ``16 * sigmoid(...)`` lies in ``(0, 16)``


def log_spaced_coords(table_window: int, pretrained_window: int) -> torch.Tensor:
    """``((2 tw - 1)**2, 2)`` fp32 ``(f(dy), f(dx))`` in :func:`~.windows.relative_position_index`
    order, ``f(d) = sign(d) * log2(1 + 8 |d| / (n - 1)) / log2(8)``, ``n = pretrained_window or tw``."""
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


get_log_spaced_coords = size_cache(maxsize=64)(_coords_on)


def continuous_position_bias(cpb_mlp: nn.Module, table_window: int, pretrained_window: int, plan: Plan) -> torch.Tensor:
    """``16 * sigmoid(cpb_mlp(coords))``: the ``((2 tw - 1)**2, nH)`` bias table, in the MLP's dtype."""
    weight = cpb_mlp[0].weight  # (not parameters(): FSDP sets plain tensors while it recomputes a unit)
    coords = (_coords_on if plan.traceable else get_log_spaced_coords)(table_window, pretrained_window, weight.device,
                                                                     weight.dtype)
    return torch.sigmoid(cpb_mlp(coords)).mul(BIAS_SCALE)


def cosine_qkv(qkv: torch.Tensor, logit_scale: torch.Tensor, num_heads: int,
               plan: Optional[Plan] = None) -> torch.Tensor:
    """``(..., 3C)`` tokens (any order) -> ``[normalize(q) * exp(min(logit_scale, log 100)),
    normalize(k), v]`` per head, in ``qkv``'s dtype, bit-identical on every path; ``logit_scale``
    ``(nH, 1, 1)``. With a ``plan``, ``qkv`` (a module's output) is overwritten where the plan
    allows writing module outputs and no grad is recorded.

    q and k are normalised in fp32 (fp64 for fp64): in fp16 a squared norm can overflow and the
    epsilon underflows to 0, turning an all-zero (padding) key into ``0 / 0``.
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
    if plan is not None and plan.exact_modules and not plan.grad:
        with torch.no_grad():
            return _normalize_and_scale(heads, scale, inplace=True)[0].reshape(qkv.shape)
    if plan is not None and plan.save_memory:
        return _CosineQKV.apply(heads, scale).reshape(qkv.shape)
    return _normalize_and_scale(heads, scale, inplace=False)[0].reshape(qkv.shape)


def _normalize_and_scale(heads: torch.Tensor, scale: torch.Tensor, inplace: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(..., 3, nH, d)`` -> ``[q / |q| * scale, k / |k|, v]`` (in place or new) and the clamped
    norms ``(..., 2, nH, 1)``."""
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
    """:func:`cosine_qkv` (fp32 / fp64) keeping its output, norms and scale for backward. With
    ``o = a x / n`` (``a``: q's scale, 1 for k), ``dx = (a g - o <g, o> [|x| > eps] / a) / n``
    and ``d scale = sum <g_q, o_q> / a``."""

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
