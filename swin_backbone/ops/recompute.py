"""Layer pairs whose backward keeps less than autograd would, recomputing cheap parts instead.

In a Swin block, autograd keeps both the input and the output of every LayerNorm (the output
is the next linear's input) and both the input and the output of the GELU. The LayerNorm and
GELU outputs are one elementwise pass away from what is kept anyway, so the functions here
keep only the inputs and recompute the outputs in backward: a block's saved activations
shrink by about a third, for two extra elementwise passes. On CPU the MLP's GELU -> fc2
forward and its whole backward run in cache-sized row chunks (chunked.py), recomputing each
chunk right where it is used. (The norm -> qkv backward runs on whole tensors: chunked, it
was not faster inside a training step; docs/performance.md.) Values and gradients are
the same as the plain modules' (tested); the plain modules run whenever no gradient is needed
or while ``torch.compile`` traces (inductor makes its own choices there).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_compat import autocast_enabled, is_compiling
from .chunked import chunk_rows, chunk_slices
from .layouts import WindowLayout, window_partition


def _fusable(norm: Optional[nn.Module], x: torch.Tensor) -> bool:
    """Whether the hand-written LayerNorm backward applies: an affine LayerNorm in x's dtype,
    or any affine LayerNorm under autocast (which runs it in :func:`_layer_norm_dtype`: the
    residual stream is in the autocast dtype there while the norm's parameters are fp32)."""
    if not (isinstance(norm, nn.LayerNorm) and norm.elementwise_affine):
        return False
    return norm.weight.dtype == x.dtype or autocast_enabled(x.device.type)


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


class _Mlp(torch.autograd.Function):
    """``fc2(gelu(fc1(x)))`` with a LayerNorm before it (``norm_first``: Swin V1's pre-norm
    branch), after it (Swin V2's post-norm branch) or none, saving for backward only ``x``,
    ``h = fc1(...)`` and the LayerNorm's statistics (post-norm: and its input ``y``), not the
    LayerNorm or GELU outputs, which are recomputed.

    In the row chunks of the GELU -> fc2 forward and the whole backward (:func:`_row_parts`),
    GELU, the recomputed LayerNorm output and every gradient exist a chunk at a time, and each
    bias / weight gradient is accumulated while its chunk is in cache. Under autocast the
    LayerNorm runs in the dtype ``nn.LayerNorm`` would, as in :class:`_NormLinear`.
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, norm_weight, norm_bias, eps: float, norm_first: bool, chunk_bytes: int):
        rows = x.reshape(-1, x.shape[-1])
        pre, post = norm_weight is not None and norm_first, norm_weight is not None and not norm_first
        mean = rstd = y = None
        ln_dtype = rows.dtype
        if pre:
            ln_dtype = _layer_norm_dtype(rows, norm_weight, norm_bias, eps)
            rows, mean, rstd = torch.native_layer_norm(rows.to(ln_dtype), rows.shape[-1:], norm_weight, norm_bias, eps)
        h = F.linear(rows, w1, b1)  # autocast applies here as for nn.Linear
        # In the output's shape, so that what is returned is no view (a caller may add a
        # residual into it in place, which autograd forbids on views made in here).
        out = _gelu_linear(h, w2, b2, x.shape[:-1], chunk_bytes)
        if post:
            y, ln_dtype = out, _layer_norm_dtype(out, norm_weight, norm_bias, eps)
            out, mean, rstd = torch.native_layer_norm(y.to(ln_dtype), (y.shape[-1],), norm_weight, norm_bias, eps)
        ctx.save_for_backward(x, w1, h, w2, y, mean, rstd, norm_weight, norm_bias)
        ctx.eps, ctx.pre, ctx.post, ctx.chunk_bytes, ctx.ln_dtype = eps, pre, post, chunk_bytes, ln_dtype
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (w1, b1, w2, b2, norm_weight, norm_bias))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w1, h, w2, y, mean, rstd, norm_weight, norm_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad  # x, w1, b1, w2, b2, norm_weight, norm_bias, eps, norm_first, chunk_bytes
        pre, post, ln_dtype = ctx.pre, ctx.post, ctx.ln_dtype
        dtype, channels, width = h.dtype, x.shape[-1], w2.shape[0]
        acc = torch.promote_types(dtype, torch.float32)  # fp16 / bf16 reduce in fp32
        w1c, w2c = w1.to(dtype), w2.to(dtype)
        rows, grad_rows = x.reshape(-1, channels), grad.reshape(-1, width)
        if mean is not None:
            mean, rstd = mean.reshape(-1, 1), rstd.reshape(-1, 1)

        def zeros(shape, needed, like=acc):
            return rows.new_zeros(shape, dtype=like) if needed else None

        def empty(shape, needed):  # written by the first chunk's matmul: no zero-fill pass
            return rows.new_empty(shape, dtype=acc) if needed else None

        ln_acc = torch.promote_types(ln_dtype, torch.float32)
        norm_width = width if post else channels
        grad_nw, grad_nb = zeros(norm_width, needs[5], ln_acc), zeros(norm_width, needs[6], ln_acc)
        grad_x = torch.empty_like(rows) if needs[0] else None
        grad_w1, grad_b1 = empty(w1.shape, needs[1]), zeros(w1.shape[0], needs[2])
        grad_w2, grad_b2 = empty(w2.shape, needs[3]), zeros(w2.shape[0], needs[4])
        below_fc1 = needs[0] or (pre and (needs[5] or needs[6]))  # the gradient of fc1's input
        below_fc2 = below_fc1 or needs[1] or needs[2]
        for i, part in enumerate(_row_parts(h, ctx.chunk_bytes)):
            g = grad_rows[part]
            if post:
                g, dnw, dnb = torch.ops.aten.native_layer_norm_backward(
                    g.to(ln_dtype), y.view(-1, width)[part].to(ln_dtype), (width,), mean[part], rstd[part],
                    norm_weight, norm_bias, [below_fc2 or needs[3] or needs[4], needs[5], needs[6]])
                _add(grad_nw, dnw)
                _add(grad_nb, dnb)
                if g is None:
                    continue
            g = g.to(dtype)
            if grad_b2 is not None:
                grad_b2 += g.sum(0, dtype=acc)
            if grad_w2 is not None:
                _accumulate_mm(grad_w2, g.t(), F.gelu(h[part]), first=i == 0)
            if not below_fc2:
                continue
            grad_h = torch.ops.aten.gelu_backward(g @ w2c, h[part])
            if grad_b1 is not None:
                grad_b1 += grad_h.sum(0, dtype=acc)
            if grad_w1 is not None:
                inputs = rows[part]
                if pre:
                    inputs = torch.native_layer_norm(
                        inputs.to(ln_dtype), (channels,), norm_weight, norm_bias, ctx.eps)[0]
                _accumulate_mm(grad_w1, grad_h.t(), inputs.to(dtype), first=i == 0)
            if not below_fc1:
                continue
            grad_in = grad_h @ w1c
            if pre:
                grad_in, dnw, dnb = torch.ops.aten.native_layer_norm_backward(
                    grad_in.to(ln_dtype), rows[part].to(ln_dtype), (channels,), mean[part], rstd[part], norm_weight,
                    norm_bias, [needs[0], needs[5], needs[6]])
                _add(grad_nw, dnw)
                _add(grad_nb, dnb)
            if grad_x is not None:
                grad_x[part] = grad_in
        grads = (grad_w1, grad_b1, grad_w2, grad_b2, grad_nw, grad_nb)  # each in its parameter's dtype
        return (None if grad_x is None else grad_x.view(x.shape),
                *(None if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes)), None, None, None)


def _add(total: Optional[torch.Tensor], part: Optional[torch.Tensor]) -> None:
    if total is not None:
        total += part


def _gelu_linear(h: torch.Tensor, w2: torch.Tensor, b2, lead_shape, chunk_bytes: int) -> torch.Tensor:
    """``fc2(gelu(h))`` for ``(R, hidden)`` rows ``h``, a row chunk at a time (the GELU output
    of one chunk stays in cache and is never kept), as a new ``(*lead_shape, C_out)`` tensor in
    ``h``'s dtype."""
    w2c = w2.to(h.dtype)
    result = h.new_empty(*lead_shape, w2.shape[0])
    out = result.view(-1, w2.shape[0])
    for part in _row_parts(h, chunk_bytes):
        if is_compiling():  # dynamo of torch < 2.4 cannot trace out= with symbolic sizes
            out[part] = torch.matmul(F.gelu(h[part]), w2c.t())
        else:
            torch.matmul(F.gelu(h[part]), w2c.t(), out=out[part])
    if b2 is not None:
        out.add_(b2.to(h.dtype))
    return result


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``out = a @ b`` if ``first``, else ``out += a @ b`` (``out`` may be a wider accumulation
    dtype than ``a`` and ``b``)."""
    if out.dtype == a.dtype and first:
        torch.mm(a, b, out=out)
    elif out.dtype == a.dtype:
        out.addmm_(a, b)
    elif first:
        out.copy_(a @ b)
    else:
        out += a @ b


def _row_parts(h: torch.Tensor, chunk_bytes: int):
    """Row slices of ``h`` ``(rows, width)`` of ``chunk_bytes`` each (0: one slice). fp16 / bf16
    always run as one slice: their weight gradients need one fp32-accumulating matmul."""
    rows = h.shape[0]
    chunked = chunk_bytes > 0 and h.dtype in (torch.float32, torch.float64)
    return chunk_slices(rows, chunk_rows(h.shape[-1], h.element_size(), chunk_bytes) if chunked else rows)


class _NormLinear(torch.autograd.Function):
    """``F.linear(partition(layer_norm(x)), weight, bias)`` that saves ``x`` and its statistics.

    The normalised tokens (the linear's input) are recomputed in backward from ``x``, the
    per-token mean and reciprocal std; ``layout`` (optional) gathers them into windows. Under
    autocast the LayerNorm runs in the dtype ``nn.LayerNorm`` would (fp32 on CUDA, the
    input's on the CPU); ``x`` is kept in its own dtype.
    """

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps: float, weight, bias, layout: Optional[WindowLayout]):
        ln_dtype = _layer_norm_dtype(x, norm_weight, norm_bias, eps)
        normed, mean, rstd = torch.native_layer_norm(x.to(ln_dtype), (x.shape[-1],), norm_weight, norm_bias, eps)
        tokens = normed if layout is None else layout.to_windows(normed)
        out = F.linear(tokens, weight, bias)  # autocast applies here as for nn.Linear
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        ctx.eps, ctx.layout, ctx.ln_dtype = eps, layout, ln_dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        channels, x_ln = (x.shape[-1],), x.to(ctx.ln_dtype)
        normed = torch.native_layer_norm(x_ln, channels, norm_weight, norm_bias, ctx.eps)[0]
        tokens = normed if ctx.layout is None else ctx.layout.to_windows(normed)
        grad_tokens, grad_w, grad_b = _linear_backward(grad, tokens, weight, (any(needs[:3]), needs[4], needs[5]))
        if grad_tokens is None:
            return None, None, None, None, grad_w, grad_b, None
        grad_normed = grad_tokens if ctx.layout is None else ctx.layout.to_tokens(grad_tokens)
        grad_x, grad_nw, grad_nb = torch.ops.aten.native_layer_norm_backward(
            grad_normed.to(ctx.ln_dtype), x_ln, channels, mean, rstd, norm_weight, norm_bias, list(needs[:3])
        )
        grad_x, grad_nw, grad_nb = (g if g is None else g.to(like.dtype) for g, like in
                                    ((grad_x, x), (grad_nw, norm_weight), (grad_nb, norm_bias)))
        return grad_x, grad_nw, grad_nb, None, grad_w, grad_b, None


def norm_linear(x: torch.Tensor, norm: nn.Module, weight: torch.Tensor, bias: Optional[torch.Tensor],
                layout: Optional[WindowLayout] = None) -> torch.Tensor:
    """``F.linear(window_partition(norm(x), layout), weight, bias)`` (no partition when
    ``layout`` is None), keeping only ``x`` and the LayerNorm statistics for backward
    (:class:`_NormLinear`; ``norm`` other than an affine ``nn.LayerNorm`` runs unfused):
    ``(B, L, C)`` tokens (``L = H * W`` of ``layout``) -> ``(B, nW * N, C_out)``, or without a
    layout ``(..., C)`` -> ``(..., C_out)``.
    """
    if _fusable(norm, x):
        return _NormLinear.apply(x, norm.weight, norm.bias, norm.eps, weight, bias, layout)
    normed = norm(x)
    return F.linear(normed if layout is None else window_partition(normed, layout), weight, bias)


def _layer_norm_dtype(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.dtype:
    """The dtype ``nn.LayerNorm`` computes ``y`` in: autocast may cast it (to fp32 on CUDA,
    not on the CPU), so an empty input asks autocast's own rule."""
    if not autocast_enabled(y.device.type):
        return y.dtype
    return F.layer_norm(y.new_empty(0, y.shape[-1]), (y.shape[-1],), weight, bias, eps).dtype


def mlp(x: torch.Tensor, fc1: nn.Linear, fc2: nn.Linear, norm: Optional[nn.Module], norm_first: bool,
        chunk_bytes: int = 0) -> torch.Tensor:
    """``fc2(gelu(fc1(norm(x))))`` (``norm_first``) or ``norm(fc2(gelu(fc1(x))))``, keeping
    only ``x``, ``fc1``'s output and the LayerNorm's statistics (and input) for backward
    (:class:`_Mlp`; ``norm`` other than an affine ``nn.LayerNorm`` or None runs unfused):
    ``(..., C)`` -> ``(..., C_out)``, a tensor of its own (a residual may be added into it in
    place). ``chunk_bytes``: row-chunk size of the GELU -> fc2 forward and the backward (0: whole).
    """
    if norm is None or _fusable(norm, x):
        nw, nb, eps = (None, None, 0.0) if norm is None else (norm.weight, norm.bias, norm.eps)
        return _Mlp.apply(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, nw, nb, eps, norm_first, chunk_bytes)
    return mlp_branch(x, lambda rows: fc2(F.gelu(fc1(rows))), norm, norm_first)


def mlp_branch(x: torch.Tensor, mlp: Callable[[torch.Tensor], torch.Tensor], norm: Optional[nn.Module],
               norm_first: bool) -> torch.Tensor:
    """The MLP branch as plain calls: ``mlp(norm(x))`` (``norm_first``) or ``norm(mlp(x))``."""
    if norm is None:
        return mlp(x)
    return mlp(norm(x)) if norm_first else norm(mlp(x))
