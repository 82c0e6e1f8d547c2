"""Layer pairs whose backward keeps less than autograd would, recomputing cheap parts instead.

In a Swin block, autograd keeps both the input and the output of every LayerNorm (the output
is the next linear's input) and both the input and the output of the GELU. The LayerNorm and
GELU outputs are one elementwise pass away from what is kept anyway, so the functions here
keep only the inputs and recompute the outputs in backward: a block's saved activations
shrink by about a third, for two extra elementwise passes. Values and gradients are the
same as the plain modules' (tested); the plain modules run whenever no gradient is needed or
while ``torch.compile`` traces (inductor makes its own choices there).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .chunked import chunk_rows
from .windows import WindowLayout, window_partition


def _saves_memory(*tensors: torch.Tensor) -> bool:
    """Whether a backward pass will need these activations (and we may replace autograd's)."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and any(t.requires_grad for t in tensors)


def _linear_backward(grad: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, needs: tuple):
    """Gradients of ``F.linear(inputs, weight, bias)`` w.r.t. ``(inputs, weight, bias)``.

    Computed in ``grad``'s dtype (the forward's autocast dtype); parameter gradients are
    returned in the parameters' dtype.
    """
    grad_2d = grad.reshape(-1, grad.shape[-1])
    grad_in = grad @ weight.to(grad.dtype) if needs[0] else None
    grad_w = grad_2d.t().mm(inputs.reshape(-1, inputs.shape[-1]).to(grad.dtype)).to(weight.dtype) if needs[1] else None
    grad_b = grad_2d.sum(0).to(weight.dtype) if needs[2] else None
    return grad_in, grad_w, grad_b


class _GeluLinear(torch.autograd.Function):
    """``F.linear(F.gelu(h), weight, bias)`` that saves only ``h`` for the backward pass.

    Both passes run in row chunks (chunked.py), so ``gelu(h)`` and its gradient exist only a
    chunk at a time; fp16 / bf16 run whole, so the weight gradient is accumulated by one matmul.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        w = weight.to(h.dtype)  # autocast: h is already in the compute dtype
        rows = h.reshape(-1, h.shape[-1])
        out = rows.new_empty(rows.shape[0], w.shape[0])
        for part in _row_parts(rows.shape[0], h):
            torch.matmul(F.gelu(rows[part]), w.t(), out=out[part])
        if bias is not None:
            out.add_(bias.to(h.dtype))
        ctx.save_for_backward(h, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.view(*h.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        w = weight.to(h.dtype)
        acc = torch.promote_types(h.dtype, torch.float32)  # fp16 / bf16 reduce in fp32
        rows, grad_rows = h.reshape(-1, h.shape[-1]), grad.reshape(-1, grad.shape[-1]).to(h.dtype)
        grad_h = torch.empty_like(rows) if needs[0] else None
        grad_w = rows.new_zeros(w.shape, dtype=acc) if needs[1] else None
        for part in _row_parts(rows.shape[0], h):
            act = F.gelu(rows[part])
            if grad_w is not None:
                if acc == act.dtype:
                    grad_w.addmm_(grad_rows[part].t(), act)
                else:
                    grad_w += grad_rows[part].t() @ act
            if grad_h is not None:
                torch.ops.aten.gelu_backward.grad_input(grad_rows[part] @ w, rows[part], grad_input=grad_h[part])
        return (
            None if grad_h is None else grad_h.view(h.shape),
            None if grad_w is None else grad_w.to(weight.dtype),
            grad_rows.sum(0, dtype=acc).to(ctx.bias_dtype) if needs[2] else None,
        )


def _row_parts(num_rows: int, h: torch.Tensor):
    """Row slices of :func:`~swin_backbone.chunked.chunk_rows` size (one slice for fp16/bf16,
    whose weight gradient must accumulate in a single fp32-accumulating matmul)."""
    step = chunk_rows(h.shape[-1], h.element_size()) if h.dtype in (torch.float32, torch.float64) else num_rows
    return [slice(start, start + step) for start in range(0, max(num_rows, 1), max(step, 1))]


class _NormLinear(torch.autograd.Function):
    """``F.linear(partition(layer_norm(x)), weight, bias)`` that saves ``x`` and its statistics.

    The normalised tokens (the linear's input) are recomputed in backward from ``x``, the
    per-token mean and reciprocal std; ``layout`` (optional) gathers them into windows.
    """

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps: float, weight, bias, layout: Optional[WindowLayout]):
        normed, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), norm_weight, norm_bias, eps)
        tokens = normed if layout is None else layout.to_windows(normed)
        out = F.linear(tokens, weight, bias)  # autocast applies here as for nn.Linear
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        ctx.eps, ctx.layout = eps, layout
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        channels = (x.shape[-1],)
        normed = torch.native_layer_norm(x, channels, norm_weight, norm_bias, ctx.eps)[0]
        tokens = normed if ctx.layout is None else ctx.layout.to_windows(normed)
        grad_tokens, grad_w, grad_b = _linear_backward(grad, tokens, weight, (any(needs[:3]), needs[4], needs[5]))
        if grad_tokens is None:
            return None, None, None, None, grad_w, grad_b, None
        grad_normed = grad_tokens if ctx.layout is None else ctx.layout.to_tokens(grad_tokens)
        grad_x, grad_nw, grad_nb = torch.ops.aten.native_layer_norm_backward(
            grad_normed.to(x.dtype), x, channels, mean, rstd, norm_weight, norm_bias, list(needs[:3])
        )
        return grad_x, grad_nw, grad_nb, None, grad_w, grad_b, None


def gelu_linear(h: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(gelu(h))``; in training keeps ``h`` only (not ``gelu(h)``) for backward."""
    if _saves_memory(h, linear.weight):
        return _GeluLinear.apply(h, linear.weight, linear.bias)
    return linear(F.gelu(h))


def norm_linear(x: torch.Tensor, norm: nn.Module, linear: nn.Linear, layout: Optional[WindowLayout] = None) -> torch.Tensor:
    """``linear(window_partition(norm(x), layout))`` (no partition when ``layout`` is None).

    Args:
        x: ``(B, L, C)`` tokens (``L = H * W`` of ``layout``) or any ``(..., C)`` without one.
        norm: an affine ``nn.LayerNorm`` over ``C`` (anything else runs unfused).
    Returns:
        ``(B, nW * N, C_out)`` with a layout, else ``(..., C_out)``.
    """
    fusable = isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and norm.weight.dtype == x.dtype
    if fusable and _saves_memory(x, norm.weight, linear.weight):
        return _NormLinear.apply(x, norm.weight, norm.bias, norm.eps, linear.weight, linear.bias, layout)
    normed = norm(x)
    return linear(normed if layout is None else window_partition(normed, layout))
