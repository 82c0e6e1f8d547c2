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

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_compat import autocast_enabled, is_compiling
from .chunked import chunk_rows, chunk_slices
from .windows import WindowLayout, window_partition


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


class _NormMlp(torch.autograd.Function):
    """``fc2(gelu(fc1(layer_norm(x))))`` (LayerNorm optional) that saves ``x``, the LayerNorm
    statistics and ``h = fc1(...)`` for backward, not the LayerNorm or GELU outputs.

    The GELU -> fc2 forward and the whole backward run in row chunks (chunked.py): GELU, the
    recomputed LayerNorm output and every gradient exist a chunk at a time, and each bias /
    weight gradient is accumulated while its chunk is in cache. fp16 / bf16 run as one chunk,
    so their weight gradients come from single fp32-accumulating matmuls. Under autocast the
    LayerNorm runs in the dtype ``nn.LayerNorm`` would, as in :class:`_NormLinear`.
    """

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, eps: float, w1, b1, w2, b2, chunk_bytes: int):
        rows = x.reshape(-1, x.shape[-1])
        mean = rstd = None
        normed, ln_dtype = rows, rows.dtype
        if norm_weight is not None:
            ln_dtype = _layer_norm_dtype(rows, norm_weight, norm_bias, eps)
            normed, mean, rstd = torch.native_layer_norm(rows.to(ln_dtype), (rows.shape[-1],), norm_weight, norm_bias, eps)
        h = F.linear(normed, w1, b1)  # autocast applies here as for nn.Linear
        # In the output's shape, so that what is returned is no view (a caller may add a
        # residual into it in place, which autograd forbids on views made in here).
        result = _gelu_linear(h, w2, b2, x.shape[:-1], chunk_bytes)
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, w1, h, w2)
        ctx.eps, ctx.chunk_bytes, ctx.ln_dtype = eps, chunk_bytes, ln_dtype
        ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, mean, rstd, norm_weight, norm_bias, w1, h, w2 = ctx.saved_tensors
        needs = ctx.needs_input_grad  # x, norm_weight, norm_bias, eps, w1, b1, w2, b2
        dtype, channels = h.dtype, x.shape[-1]
        acc = torch.promote_types(dtype, torch.float32)  # fp16 / bf16 reduce in fp32
        w1c, w2c = w1.to(dtype), w2.to(dtype)
        rows, grad_rows = x.reshape(-1, channels), grad.reshape(-1, grad.shape[-1]).to(dtype)

        def zeros(shape, needed):
            return rows.new_zeros(shape, dtype=acc) if needed else None

        def empty(shape, needed):  # written by the first chunk's matmul: no zero-fill pass
            return rows.new_empty(shape, dtype=acc) if needed else None

        grad_x = torch.empty_like(rows) if needs[0] else None
        grad_nw, grad_nb = zeros(channels, needs[1]), zeros(channels, needs[2])
        grad_w1, grad_b1 = empty(w1.shape, needs[4]), zeros(w1.shape[0], needs[5])
        grad_w2 = empty(w2.shape, needs[6])
        below_fc1 = any(needs[:3])
        for i, part in enumerate(_row_parts(h, ctx.chunk_bytes)):
            act = F.gelu(h[part])
            if grad_w2 is not None:
                _accumulate_mm(grad_w2, grad_rows[part].t(), act, first=i == 0)
            if not (below_fc1 or needs[4] or needs[5]):
                continue
            grad_h = torch.ops.aten.gelu_backward(grad_rows[part] @ w2c, h[part])
            if grad_b1 is not None:
                grad_b1 += grad_h.sum(0, dtype=acc)
            if grad_w1 is not None:
                normed = rows[part]
                if norm_weight is not None:
                    normed = torch.native_layer_norm(
                        normed.to(ctx.ln_dtype), (channels,), norm_weight, norm_bias, ctx.eps)[0]
                _accumulate_mm(grad_w1, grad_h.t(), normed.to(dtype), first=i == 0)
            if not below_fc1:
                continue
            grad_normed = (grad_h @ w1c).to(ctx.ln_dtype)
            if norm_weight is None:
                grad_x[part] = grad_normed
                continue
            dx, dnw, dnb = torch.ops.aten.native_layer_norm_backward(
                grad_normed, rows[part].to(ctx.ln_dtype), (channels,), mean[part], rstd[part], norm_weight, norm_bias,
                list(needs[:3]),
            )
            if grad_x is not None:
                grad_x[part] = dx
            if grad_nw is not None:
                grad_nw += dnw
            if grad_nb is not None:
                grad_nb += dnb
        b1_dtype, b2_dtype = ctx.bias_dtypes
        return (
            None if grad_x is None else grad_x.view(x.shape),
            None if grad_nw is None else grad_nw.to(norm_weight.dtype),
            None if grad_nb is None else grad_nb.to(norm_bias.dtype),
            None,
            None if grad_w1 is None else grad_w1.to(w1.dtype),
            None if grad_b1 is None else grad_b1.to(b1_dtype),
            None if grad_w2 is None else grad_w2.to(w2.dtype),
            grad_rows.sum(0, dtype=acc).to(b2_dtype) if needs[7] else None,
            None,
        )


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


def norm_mlp(x: torch.Tensor, norm: Optional[nn.Module], fc1: nn.Linear, fc2: nn.Linear, chunk_bytes: int = 0) -> torch.Tensor:
    """``fc2(gelu(fc1(norm(x))))`` (``norm`` may be None) keeping only ``x``, the LayerNorm
    statistics and ``fc1``'s output for backward (:class:`_NormMlp`).

    Args:
        x: ``(..., C)``. norm: an affine ``nn.LayerNorm`` (anything else runs unfused) or None.
        chunk_bytes: row-chunk size of the GELU -> fc2 forward and the backward (0: whole).
    """
    if norm is None or _fusable(norm, x):
        nw, nb, eps = (None, None, 0.0) if norm is None else (norm.weight, norm.bias, norm.eps)
        return _NormMlp.apply(x, nw, nb, eps, fc1.weight, fc1.bias, fc2.weight, fc2.bias, chunk_bytes)
    return fc2(F.gelu(fc1(norm(x))))


def norm_linear(x: torch.Tensor, norm: nn.Module, linear: nn.Linear, layout: Optional[WindowLayout] = None) -> torch.Tensor:
    """``linear(window_partition(norm(x), layout))`` (no partition when ``layout`` is None),
    keeping only ``x`` and the LayerNorm statistics for backward (:class:`_NormLinear`).

    Args:
        x: ``(B, L, C)`` tokens (``L = H * W`` of ``layout``) or any ``(..., C)`` without one.
        norm: an affine ``nn.LayerNorm`` over ``C`` (anything else runs unfused).
    Returns:
        ``(B, nW * N, C_out)`` with a layout, else ``(..., C_out)``.
    """
    if _fusable(norm, x):
        return _NormLinear.apply(x, norm.weight, norm.bias, norm.eps, linear.weight, linear.bias, layout)
    normed = norm(x)
    return linear(normed if layout is None else window_partition(normed, layout))


class _MlpNorm(torch.autograd.Function):
    """``layer_norm(fc2(gelu(fc1(x))))`` (Swin V2's post-norm MLP branch) that saves ``x``,
    ``h = fc1(x)``, the LayerNorm's input ``y`` and statistics for backward, not the GELU
    output (which fc2's backward needs: recomputed from ``h``).

    As :class:`_NormMlp`, the GELU -> fc2 forward and the whole backward (here including the
    LayerNorm's) run in row chunks; fp16 / bf16 run as one chunk. Under autocast the
    LayerNorm runs in the dtype ``nn.LayerNorm`` would (fp32 on CUDA, the input's on the CPU).
    """

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, norm_weight, norm_bias, eps: float, chunk_bytes: int):
        rows = x.reshape(-1, x.shape[-1])
        h = F.linear(rows, w1, b1)  # autocast applies here as for nn.Linear
        y = _gelu_linear(h, w2, b2, x.shape[:-1], chunk_bytes)
        ln_dtype = _layer_norm_dtype(y, norm_weight, norm_bias, eps)
        out, mean, rstd = torch.native_layer_norm(y.to(ln_dtype), (y.shape[-1],), norm_weight, norm_bias, eps)
        ctx.save_for_backward(x, w1, h, w2, y, mean, rstd, norm_weight, norm_bias)
        ctx.chunk_bytes, ctx.ln_dtype = chunk_bytes, ln_dtype
        ctx.bias_dtypes = (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w1, h, w2, y, mean, rstd, norm_weight, norm_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad  # x, w1, b1, w2, b2, norm_weight, norm_bias, eps, chunk_bytes
        dtype, channels, width = h.dtype, x.shape[-1], y.shape[-1]
        acc = torch.promote_types(dtype, torch.float32)  # fp16 / bf16 reduce in fp32
        w1c, w2c = w1.to(dtype), w2.to(dtype)
        rows, grad_rows = x.reshape(-1, channels), grad.reshape(-1, width)
        y_rows, mean, rstd = y.view(-1, width), mean.reshape(-1, 1), rstd.reshape(-1, 1)

        def zeros(shape, needed, like=acc):
            return rows.new_zeros(shape, dtype=like) if needed else None

        def empty(shape, needed):  # written by the first chunk's matmul: no zero-fill pass
            return rows.new_empty(shape, dtype=acc) if needed else None

        ln_acc = torch.promote_types(ctx.ln_dtype, torch.float32)
        grad_nw, grad_nb = zeros(width, needs[5], ln_acc), zeros(width, needs[6], ln_acc)
        grad_x = torch.empty_like(rows) if needs[0] else None
        grad_w1, grad_b1 = empty(w1.shape, needs[1]), zeros(w1.shape[0], needs[2])
        grad_w2, grad_b2 = empty(w2.shape, needs[3]), zeros(w2.shape[0], needs[4])
        below_norm = any(needs[:5])
        below_fc2 = any(needs[:3])
        for i, part in enumerate(_row_parts(h, ctx.chunk_bytes)):
            dy, dnw, dnb = torch.ops.aten.native_layer_norm_backward(
                grad_rows[part].to(ctx.ln_dtype), y_rows[part].to(ctx.ln_dtype), (width,), mean[part], rstd[part],
                norm_weight, norm_bias, [below_norm, needs[5], needs[6]],
            )
            if grad_nw is not None:
                grad_nw += dnw
            if grad_nb is not None:
                grad_nb += dnb
            if not below_norm:
                continue
            dy = dy.to(dtype)
            if grad_b2 is not None:
                grad_b2 += dy.sum(0, dtype=acc)
            if grad_w2 is not None:
                _accumulate_mm(grad_w2, dy.t(), F.gelu(h[part]), first=i == 0)
            if not below_fc2:
                continue
            grad_h = torch.ops.aten.gelu_backward(dy @ w2c, h[part])
            if grad_b1 is not None:
                grad_b1 += grad_h.sum(0, dtype=acc)
            if grad_w1 is not None:
                _accumulate_mm(grad_w1, grad_h.t(), rows[part].to(dtype), first=i == 0)
            if grad_x is not None:
                grad_x[part] = grad_h @ w1c
        b1_dtype, b2_dtype = ctx.bias_dtypes
        return (
            None if grad_x is None else grad_x.view(x.shape),
            None if grad_w1 is None else grad_w1.to(w1.dtype),
            None if grad_b1 is None else grad_b1.to(b1_dtype),
            None if grad_w2 is None else grad_w2.to(w2.dtype),
            None if grad_b2 is None else grad_b2.to(b2_dtype),
            None if grad_nw is None else grad_nw.to(norm_weight.dtype),
            None if grad_nb is None else grad_nb.to(norm_bias.dtype),
            None,
            None,
        )


def _layer_norm_dtype(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.dtype:
    """The dtype ``nn.LayerNorm`` computes ``y`` in: autocast may cast it (to fp32 on CUDA,
    not on the CPU), so an empty input asks autocast's own rule."""
    if not autocast_enabled(y.device.type):
        return y.dtype
    return F.layer_norm(y.new_empty(0, y.shape[-1]), (y.shape[-1],), weight, bias, eps).dtype


def mlp_norm(x: torch.Tensor, fc1: nn.Linear, fc2: nn.Linear, norm: nn.Module, chunk_bytes: int = 0) -> torch.Tensor:
    """``norm(fc2(gelu(fc1(x))))`` (Swin V2's post-norm MLP branch) keeping only ``x``,
    ``fc1``'s output and the LayerNorm's input and statistics for backward (:class:`_MlpNorm`).

    Args:
        x: ``(..., C)``. norm: an affine ``nn.LayerNorm`` over ``fc2``'s output (anything
            else runs unfused).
        chunk_bytes: row-chunk size of the GELU -> fc2 forward and the backward (0: whole).
    Returns:
        ``(..., C_out)``, a tensor of its own (a residual may be added into it in place).
    """
    if _fusable(norm, x):
        return _MlpNorm.apply(
            x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, norm.weight, norm.bias, norm.eps, chunk_bytes
        )
    return norm(fc2(F.gelu(fc1(x))))
