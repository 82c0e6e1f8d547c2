"""Window multi-head self-attention with a relative position bias: the algorithm and its kernels.

:func:`reference_window_attention` is the whole algorithm in plain torch, to hold against the
paper. Every kernel is the same computation, fused (tested against it): each computes
``softmax(q k^T * scale + bias + mask) v`` inside every window and returns the result in
row-major token order; :func:`window_attention` runs the one the plan names
(:mod:`swin_backbone.ops.planner` decides):

* ``sdpa``: ``F.scaled_dot_product_attention`` with the bias (+ region mask) as an additive
  float mask. On CUDA its memory-efficient kernel also gives the bias gradient; masks and
  biases handed to it satisfy that kernel's conditions (last-dim stride 1, rows aligned to 8
  elements, the query's dtype: :func:`sdpa_ready`), so it never falls to the math kernel.
* ``plain``: matmul + softmax with autograd's own graph (attention dropout; tracing).
* ``recompute``: CPU training: the SDPA forward, and a hand-written backward that recomputes
  the probabilities from ``qkv`` (:class:`_RecomputedAttention`); small layers keep them.
* ``triton`` (CUDA): :mod:`swin_backbone.ops.triton_attention`, reading row-major tokens.

Masked windows (shift regions, padding) have two strategies: one ``(nW, nH, N, N)`` bias for
every window, or, where masked windows are few (CPU), every window with the shared bias and
the masked ones recomputed with theirs. All give the same numbers (tested).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_compat import scaled_dot_product_attention
from . import kernel_choice
from .chunked import chunk_rows, chunk_slices
from .layouts import ImageWindows, WindowLayout, get_relative_position_index, window_partition, window_reverse
from .planner import Plan
from .triton_ops import fused_window_attention
from .windows import padded_size, relative_position_index, window_attention_mask


def reference_window_attention(
    x: torch.Tensor, qkv: nn.Linear, proj: nn.Linear, table: torch.Tensor, table_window: int, height: int, width: int,
    window: int, shift: int, num_heads: int, scale: float, mask_padding: bool = True,
) -> torch.Tensor:
    """(Shifted) window multi-head self-attention (Liu et al. 2021, section 3.2), written out.

    Args:
        x: ``(B, H * W, C)`` row-major tokens (after the block's norm).
        qkv, proj: the input and output projections; table: ``((2 tw - 1) ** 2, nH)``
            relative position bias table of a ``tw = table_window`` window.
        window, shift: the window ``ws`` and the cyclic shift (0 or ``ws // 2``).
        mask_padding: padding tokens form their own region (real tokens never attend to them).
    Returns:
        ``(B, H * W, C)``.
    """
    batch, _, channels = x.shape
    hp, wp = padded_size(height, window), padded_size(width, window)
    n, head_dim = window * window, channels // num_heads
    # 1. Pad bottom / right to whole windows, then shift cyclically by -shift.
    x = F.pad(x.view(batch, height, width, channels), (0, 0, 0, wp - width, 0, hp - height))
    x = torch.roll(x, (-shift, -shift), (1, 2))
    # 2. Cut into nW windows of N tokens and project: (B, nW, N, 3, nH, d) -> q, k, v (B, nW, nH, N, d).
    x = x.view(batch, hp // window, window, wp // window, window, channels).transpose(2, 3)
    x = x.reshape(batch, -1, n, channels)
    q, k, v = qkv(x).view(batch, -1, n, 3, num_heads, head_dim).permute(3, 0, 1, 4, 2, 5).unbind(0)
    # 3. Scaled dot product + relative position bias B[dy, dx]; after a shift (or on padding)
    #    tokens of different regions must not attend to each other: an additive mask.
    bias = table[relative_position_index(window, table_window, x.device)].view(n, n, num_heads).permute(2, 0, 1)
    logits = q @ k.transpose(-2, -1) * scale + bias
    mask = window_attention_mask(height, width, window, shift, mask_padding, x.device, logits.dtype)
    if mask is not None:
        logits = logits + mask[:, None]
    out = logits.softmax(-1) @ v
    # 4. Merge the windows, undo the shift, crop the padding, project.
    out = out.transpose(2, 3).reshape(batch, hp // window, wp // window, window, window, channels)
    out = torch.roll(out.transpose(2, 3).reshape(batch, hp, wp, channels), (shift, shift), (1, 2))
    return proj(out[:, :height, :width].reshape(batch, height * width, channels))


def relative_position_bias(table: torch.Tensor, window: int, table_window: int) -> torch.Tensor:
    """``(nH, N, N)`` contiguous bias of a ``window x window`` window from a
    ``((2 * tw - 1) ** 2, nH)`` table (``window <= tw``: a subset of its offsets)."""
    index = get_relative_position_index(window, table_window, table.device)
    n = window * window
    return table.t().index_select(1, index).view(-1, n, n)


def sdpa_ready(bias: torch.Tensor, dtype: torch.dtype, align: bool) -> torch.Tensor:
    """``bias`` as fused SDPA kernels take it: in ``dtype`` and, with ``align`` (CUDA), with
    its last dimension stride 1 and its rows aligned to 8 elements (CUDA's memory-efficient
    kernel copies a misaligned mask on every call; a view of a padded buffer needs no copy).
    CPU kernels take any strides."""
    bias = bias.to(dtype)
    n = bias.shape[-1]
    if not align or (bias.stride(-1) == 1 and all(st % 8 == 0 for st in bias.stride()[:-1])):
        return bias
    return F.pad(bias, (0, -n % 8)).narrow(-1, 0, n)


def per_window_bias(mask: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype, align: bool) -> torch.Tensor:
    """``mask[:, None] + bias``: ``(nW, N, N)`` and ``(nH, N, N)`` -> ``(nW, nH, N, N)`` in ``dtype``.

    With ``align`` the result is a view with 8-aligned rows, made by one addition: a mask
    cached aligned (:func:`~swin_backbone.ops.windows.window_attention_mask`) is read with its
    padding columns, the bias is padded (a small copy per block), and the sum is narrowed.
    """
    mask, bias = mask.to(dtype), bias.to(dtype)
    n = mask.shape[-1]
    pad = -n % 8
    if not align or pad == 0:
        return mask.unsqueeze(1) + bias
    if mask.stride(-1) == 1 and mask.stride(-2) == n + pad:
        mask = mask.as_strided(mask.shape[:-1] + (n + pad,), mask.stride())
    else:
        mask = F.pad(mask, (0, pad))
    return (mask.unsqueeze(1) + F.pad(bias, (0, pad))).narrow(-1, 0, n)


def run_kernel(
    qkv: torch.Tensor, bias: torch.Tensor, layout: WindowLayout, num_heads: int, scale: float, dropout_p: float = 0.0,
    kernel: str = "sdpa", fixup: bool = False, chunk_bytes: int = 0, align: bool = False,
) -> torch.Tensor:
    """Window attention over ``layout``, returned as ``(B, H * W, C)`` row-major tokens (the output
    projection then runs on real tokens only).

    Args:
        qkv: ``(B, nW * N, 3C)`` projected tokens in ``layout``'s window order.
        bias: ``(nH, N, N)`` relative position bias.
        dropout_p: attention dropout (``plain`` only).
        kernel: ``'sdpa'``, ``'plain'`` or ``'recompute'``.
        fixup: run every window with the shared bias, then redo the masked windows with
            their masks (instead of one per-window bias for all).
        chunk_bytes: ``recompute`` only: its backward's group size (see :class:`_RecomputedAttention`).
        align: hand SDPA 8-aligned biases (CUDA; see :func:`sdpa_ready`).
    """
    if kernel == "recompute":
        if dropout_p > 0:
            raise ValueError(f"kernel='recompute' has no attention dropout, got dropout_p={dropout_p}")
        return _RecomputedAttention.apply(qkv, bias, num_heads, scale, layout, fixup, chunk_bytes, align)
    if kernel not in ("sdpa", "plain"):
        raise ValueError(f"kernel: expected 'sdpa', 'plain' or 'recompute', got {kernel!r}")
    run = _sdpa if kernel == "sdpa" else _plain
    out = attention_in_windows(qkv, bias, layout, num_heads, scale, dropout_p, run, fixup, align)
    return window_reverse(out, layout)


Kernel = Callable[[torch.Tensor, torch.Tensor, bool, float, float], torch.Tensor]


def attention_in_windows(
    qkv: torch.Tensor, bias: torch.Tensor, layout: WindowLayout, num_heads: int, scale: float, dropout_p: float,
    run: Kernel, fixup: bool, align: bool = False,
) -> torch.Tensor:
    """Attention of every window with ``run`` (:func:`_sdpa` or :func:`_plain`): ``(B, nW * N, C)`` in window layout."""
    batch, tokens, three_c = qkv.shape
    num_windows = layout.num_windows
    n = tokens // num_windows
    rows = qkv.view(batch, num_windows, n, three_c)  # contiguous window rows: cheap to gather from
    qkv = _heads_first(rows, num_heads)  # (3, B, nW, nH, N, d), a view
    mask, masked = layout.mask, layout.masked_windows
    if mask is None or (fixup and masked is not None):
        out = run(qkv, sdpa_ready(bias, qkv.dtype, align).unsqueeze(0), False, scale, dropout_p)  # (B, nW, N, nH, d)
        if mask is not None and masked.numel():
            fix = sdpa_ready(layout.window_masks.to(qkv.dtype).unsqueeze(1) + bias.to(qkv.dtype), qkv.dtype, align)
            fixed = run(_heads_first(rows.index_select(1, masked), num_heads), fix, True, scale, dropout_p)
            # In place when nothing needs the old values (SDPA keeps its output for backward).
            out = out.index_copy(1, masked, fixed) if out.requires_grad else out.index_copy_(1, masked, fixed)
    else:
        out = run(qkv, per_window_bias(mask, bias, qkv.dtype, align), True, scale, dropout_p)
    images = layout.images
    if images is not None:  # the windows that images' boundaries cut, again with their own masks
        # The K windows, flat over the batch, go into the windows dimension of one "image".
        picked = rows.view(1, batch * num_windows, n, three_c).index_select(1, images.windows)
        fixed = _attend_image_windows(picked, images, bias, num_heads, scale, dropout_p, run, align)
        flat = out.flatten(0, 1)  # (B * nW, N, nH, d)
        copy = flat.index_copy if flat.requires_grad or fixed.requires_grad else flat.index_copy_
        out = copy(0, images.windows, fixed)
    return out.reshape(batch, tokens, three_c // 3)


def _heads_first(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, W, N, 3C)`` window rows -> the ``(3, B, W, nH, N, d)`` view the kernels read.

    Windows are picked (``index_select``) on the rows before this view: gathering whole
    contiguous rows is a copy of the picked windows only, where gathering from the strided
    view would first copy all of ``qkv``.
    """
    batch, num_windows, n, three_c = rows.shape
    return rows.view(batch, num_windows, n, 3, num_heads, three_c // (3 * num_heads)).permute(3, 0, 1, 4, 2, 5)


def redo_image_windows_in_tokens(
    out: torch.Tensor, qkv: torch.Tensor, bias: torch.Tensor, layout: WindowLayout, num_heads: int, scale: float,
    align: bool,
) -> torch.Tensor:
    """The windows that images' boundaries cut, for kernels on row-major tokens (the fused Triton
    one, whose region masks know nothing of per-image sizes): SDPA on them, gathered from the
    ``(B, H * W, 3C)`` ``qkv``, written over their real tokens of ``out`` ``(B, H * W, C)`` in a
    new tensor (so that autograd gives the replaced results no gradient)."""
    images = layout.images
    batch, tokens, three_c = qkv.shape
    n = layout.window * layout.window
    k = images.windows.numel()
    picked = qkv.reshape(batch * tokens, three_c).index_select(0, images.rows).view(1, k, n, three_c)
    fixed = _attend_image_windows(picked, images, bias, num_heads, scale, 0.0, _sdpa, align)
    fixed = fixed.reshape(k * n, -1).index_select(0, images.real)
    flat = out.reshape(batch * tokens, -1)
    return flat.index_copy(0, images.real_rows, fixed).view_as(out)


def _attend_image_windows(
    picked: torch.Tensor, images: ImageWindows, bias: torch.Tensor, num_heads: int, scale: float, dropout_p: float,
    run: Kernel, align: bool,
) -> torch.Tensor:
    """Attention of the ``K`` windows that images' edges cut, each with its own mask:
    ``(1, K, N, 3C)`` qkv rows -> ``(K, N, nH, d)``."""
    bias = per_window_bias(images.masks, bias, picked.dtype, align)
    return run(_heads_first(picked, num_heads), bias, True, scale, dropout_p)[0]


def _kernel_inputs(qkv: torch.Tensor, attn_bias: torch.Tensor, windows_in_heads: bool) -> Tuple[torch.Tensor, ...]:
    """``q, k, v`` of ``qkv`` ``(3, B, nW, nH, N, d)`` (a strided view) and the bias, as the kernels take them.

    Windows go into the batch dimension, ``(B * nW, nH, N, d)``, read through their strides (no
    copies), or, with ``windows_in_heads``, into the heads dimension, ``(B, nW * nH, N, d)``, so
    that per-window biases ``(nW, nH, N, N)`` broadcast over the batch (one copy of q/k/v; no
    loop over images, no batch-sized bias).
    """
    _, batch, num_windows, num_heads, n, head_dim = qkv.shape
    if not windows_in_heads:
        q, k, v = qkv.flatten(1, 2).unbind(0)  # (B * nW, nH, N, d) views
        return q, k, v, attn_bias
    q, k, v = qkv.reshape(3, batch, num_windows * num_heads, n, head_dim).unbind(0)
    return q, k, v, attn_bias.reshape(1, num_windows * num_heads, n, n)


def _sdpa(qkv: torch.Tensor, attn_bias: torch.Tensor, per_window: bool, scale: float, dropout_p: float) -> torch.Tensor:
    """SDPA of ``qkv`` ``(3, B, nW, nH, N, d)`` (a strided view). Returns ``(B, nW, N, nH, d)``, a view.

    Per-window biases of one image (and of the windows that images' edges cut, gathered as
    one) keep the windows in SDPA's batch, each with its bias: no copy (:func:`_kernel_inputs`).
    """
    q, k, v, attn_bias = _kernel_inputs(qkv, attn_bias, per_window and qkv.shape[1] != 1)
    out = scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale)
    return out.view(qkv.shape[1:]).transpose(2, 3)


def _plain(qkv: torch.Tensor, attn_bias: torch.Tensor, per_window: bool, scale: float,
           dropout_p: float) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v`` with matmuls (:func:`_kernel_inputs`). Returns ``(B, nW, N, nH, d)``."""
    q, k, v, attn_bias = _kernel_inputs(qkv, attn_bias, per_window)
    # Scale and bias in place on the fresh logits: nothing extra is kept for backward (a
    # scaled copy of q would be), and no second logits-sized temporary is made.
    attn = (q @ k.transpose(-2, -1)).mul_(scale).add_(attn_bias).softmax(dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    return (attn @ v).view(qkv.shape[1:]).transpose(2, 3)


class _RecomputedAttention(torch.autograd.Function):
    """Window attention + un-partition that keeps only ``qkv`` (and its output) for backward.

    Forward is the fused SDPA kernel (fast on CPU, no ``(..., N, N)`` tensor kept). Backward
    recomputes ``P = softmax(q k^T * scale + bias + mask)`` and applies the softmax gradient by
    hand (:func:`attention_backward`, with ``chunk_bytes`` a cache-sized group of windows at a
    time), which also yields the bias gradient that CPU SDPA cannot give. Autograd's own graph
    would keep ``P`` plus contiguous copies of ``q``, ``k`` and ``v`` (about 1.5x ``qkv``).
    The output is kept by the next linear layer anyway, so saving it here costs nothing.
    """

    @staticmethod
    def forward(ctx, qkv, bias, num_heads: int, scale: float, layout: WindowLayout, fixup: bool,
                chunk_bytes: int, align: bool):
        # Detached: CPU SDPA picks its slow math kernel for a mask that requires grad, even
        # here, where no gradient can flow through it.
        out = attention_in_windows(qkv, bias.detach(), layout, num_heads, scale, 0.0, _sdpa, fixup, align)
        out = layout.to_tokens(out)  # (B, H * W, C)
        ctx.save_for_backward(qkv, bias, out)
        ctx.num_heads, ctx.scale, ctx.layout, ctx.chunk_bytes = num_heads, scale, layout, chunk_bytes
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, bias, out = ctx.saved_tensors
        num_heads, scale, layout = ctx.num_heads, ctx.scale, ctx.layout
        num_windows, mask, images = layout.num_windows, layout.mask, layout.images
        batch, tokens, three_c = qkv.shape
        n, head_dim, dtype = tokens // num_windows, three_c // (3 * num_heads), qkv.dtype
        acc = torch.promote_types(dtype, torch.float32)  # fp16 / bf16 reduce in fp32
        # Softmax backward: dS = P * (dP - rowsum(P * dP)), and rowsum(P * dP) = rowsum(dO * O)
        # per query and head: a (B, H * W, nH) term read off the output (row-major tokens)
        # instead of the N x N logits.
        delta = (grad_out.to(acc) * out.to(acc)).view(batch, -1, num_heads, head_dim).sum(-1)
        # Back to the window layout; padding rows get zero gradient and a zero delta.
        grad_out = layout.to_windows(grad_out).view(batch, num_windows, n, num_heads, head_dim)
        delta = layout.to_windows(delta.to(dtype)).view(batch, num_windows, n, num_heads)
        qkv = qkv.view(batch, num_windows, n, 3, num_heads, head_dim)
        grad_qkv = torch.empty_like(qkv)
        grad_bias = bias.new_zeros(bias.shape, dtype=acc) if ctx.needs_input_grad[1] else None
        bias_c, mask_c = bias.to(dtype), None if mask is None else mask.to(dtype)  # once, not per chunk
        if images is not None:
            # Windows that images' boundaries cut have masks of their own: they are left out
            # of the shared-mask pass below (zero gradient and delta give them zero there)
            # and done afterwards with their masks.
            image_grads = [t.flatten(0, 1).index_select(0, images.windows).unsqueeze(0) for t in (grad_out, delta)]
            grad_out, delta = [t.flatten(0, 1).index_fill(0, images.windows, 0).view_as(t) for t in (grad_out, delta)]
        # Windows a few at a time: the chunk's logits, probabilities and gradients stay in cache.
        step = num_windows
        if ctx.chunk_bytes:
            step = chunk_rows(batch * num_heads * n * n, qkv.element_size(), ctx.chunk_bytes // 2)
        for part in chunk_slices(num_windows, step):
            part_mask = None if mask_c is None else mask_c[part]
            attention_backward(qkv[:, part], grad_out[:, part], delta[:, part], bias_c, part_mask, scale,
                               grad_qkv[:, part], grad_bias)
        if images is not None:
            image_qkv = qkv.flatten(0, 1).index_select(0, images.windows).unsqueeze(0)
            image_dqkv = torch.empty_like(image_qkv)
            attention_backward(image_qkv, *image_grads, bias_c, images.masks.to(dtype), scale, image_dqkv, grad_bias)
            grad_qkv.view((batch * num_windows,) + qkv.shape[2:]).index_copy_(0, images.windows, image_dqkv[0])
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_qkv.view(batch, tokens, three_c), grad_bias, None, None, None, None, None, None


def _split_heads(qkv: torch.Tensor, scale: float):
    """``(B, w, N, 3, nH, d)`` -> contiguous ``q * scale, k, v``, each ``(B, w, nH, N, d)``:
    one copy, after which every attention matmul is a plain batched one."""
    q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).contiguous().unbind(0)
    return q.mul_(scale), k, v  # scaled q: the logits then need no scaling pass


def _probs(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``softmax(q k^T + bias + mask)`` ``(B, w, nH, N, N)`` for :func:`_split_heads`' ``q, k``
    (``mask`` ``(w, N, N)`` or None), in ``q``'s dtype (fp16 / bf16 take the softmax in fp32)."""
    logits = torch.matmul(q, k.transpose(-2, -1)).add_(bias)
    if mask is not None:
        logits += mask.unsqueeze(1)
    acc = torch.promote_types(q.dtype, torch.float32)
    # (softmax(dtype=...) takes a slower "safe softmax" path: upcast only when needed.)
    return logits.softmax(-1) if acc == q.dtype else torch.softmax(logits, -1, dtype=acc).to(q.dtype)


def attention_backward(
    qkv: torch.Tensor, grad_out: torch.Tensor, delta: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor],
    scale: float, grad_qkv: torch.Tensor, grad_bias: Optional[torch.Tensor],
) -> None:
    """Gradients of window attention for some windows, recomputing the probabilities.

    Args:
        qkv: ``(B, w, N, 3, nH, d)`` queries, keys and values of ``w`` windows (a view).
        grad_out: ``(B, w, N, nH, d)`` gradient of the attention output.
        delta: ``(B, w, N, nH)`` ``rowsum(grad_out * out)`` per query and head.
        bias: ``(nH, N, N)``; mask: ``(w, N, N)`` or None; both in ``qkv``'s dtype.
        grad_qkv: ``(B, w, N, 3, nH, d)`` written with the gradient of ``qkv``.
        grad_bias: ``(nH, N, N)`` in fp32 or wider, accumulated into; None to skip.
    """
    dtype = qkv.dtype
    acc = torch.promote_types(dtype, torch.float32)
    q, k, v = _split_heads(qkv, scale)
    probs = _probs(q, k, bias, mask)
    grad_out = grad_out.transpose(2, 3).contiguous()  # (B, w, nH, N, d)
    grad_logits = torch.matmul(grad_out, v.transpose(-2, -1)).sub_(delta.transpose(2, 3).unsqueeze(-1)).mul_(probs)
    if grad_bias is not None:
        grad_bias += grad_logits.sum((0, 1), dtype=acc)
    grads = torch.empty((3,) + q.shape, dtype=dtype, device=q.device)
    torch.matmul(grad_logits, k, out=grads[0]).mul_(scale)
    torch.matmul(grad_logits.transpose(-2, -1), q, out=grads[1])  # q is already scaled
    torch.matmul(probs.transpose(-2, -1), grad_out, out=grads[2])
    grad_qkv.permute(3, 0, 1, 4, 2, 5).copy_(grads)


def project(tokens: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``linear(tokens)`` for ``(B, L, C)`` tokens, returned as a tensor of its own.

    ``F.linear`` on 3-d input returns a view of its 2-d result, and the block adds its residual
    into this output in place: on a view, autograd records that as a copy into the base
    (``CopySlices``), whose backward allocates, zero-fills and copies a map-sized gradient.
    ``_unsafe_view`` is the reshape ``torch.matmul`` itself returns in this case: safe
    because nothing else holds the 2-d result.
    """
    batch, length, channels = tokens.shape
    out = linear(tokens.reshape(batch * length, channels))
    return torch.ops.aten._unsafe_view(out, (batch, length, out.shape[-1]))


def window_attention(
    qkv: torch.Tensor, table: torch.Tensor, table_window: int, layout: WindowLayout, num_heads: int, scale: float,
    dropout_p: float, plan: Plan,
) -> torch.Tensor:
    """Multi-head attention inside each window with a relative position bias, by the plan's kernel:
    whichever runs, the computation is :func:`reference_window_attention` (there with the projections).

    Args:
        qkv: what :func:`swin_backbone.ops.norm_qkv` returned for the same ``layout`` and ``plan``.
        table: ``((2 * tw - 1) ** 2, nH)`` relative position bias table of a ``tw = table_window``
            window (>= ``layout.window``).
        dropout_p: attention dropout probability (applied only where the plan says dropout
            is active, i.e. in training).
    Returns:
        ``(B, H * W, C)`` row-major tokens, before the output projection.
    """
    if plan.attention == "triton":
        try:
            out = fused_window_attention(
                qkv, table, layout.height, layout.width, layout.window, layout.shift, table_window, num_heads, scale,
                plan.triton_warps, plan.tracing, _backward_fallback(table_window, layout, num_heads, scale, plan),
            )
        except Exception as error:
            if plan.attention_signature is None or plan.tracing:
                raise
            # A launch the measurement did not meet (e.g. a new compile key) failed: this call
            # runs SDPA, and the signature is decided again at the next forward.
            kernel_choice.reject(plan.attention_signature, error)
            return window_attention(window_partition(qkv, layout), table, table_window, layout, num_heads, scale,
                                    dropout_p, dataclasses.replace(plan, attention="sdpa"))
        if layout.images is None:
            return out
        # Windows that images' boundaries cut: their own masks, with SDPA (few windows).
        bias = relative_position_bias(table, layout.window, table_window)
        return redo_image_windows_in_tokens(out, qkv, bias, layout, num_heads, scale, plan.align_masks)
    bias = relative_position_bias(table, layout.window, table_window)
    fixup = layout.masked_windows is not None and plan.fixup_masked(layout.masked_windows.numel(), layout.num_windows)
    return run_kernel(
        qkv, bias, layout, num_heads, scale, dropout_p if plan.attn_dropout else 0.0, plan.attention, fixup,
        plan.chunk_bytes, plan.align_masks,
    )


def _backward_fallback(table_window: int, layout: WindowLayout, num_heads: int, scale: float, plan: Plan):
    """For an auto-chosen fused kernel: gradients through SDPA if its backward launch fails."""
    if plan.attention_signature is None or plan.tracing or not plan.grad:
        return None

    def fallback(grad_out: torch.Tensor, qkv: torch.Tensor, table: torch.Tensor):
        kernel_choice.reject(plan.attention_signature, "backward launch failed")
        with torch.enable_grad():
            q, t = qkv.detach().requires_grad_(), table.detach().requires_grad_()
            sdpa = dataclasses.replace(plan, attention="sdpa", attention_signature=None, save_memory=False)
            out = window_attention(window_partition(q, layout), t, table_window, layout, num_heads, scale, 0.0, sdpa)
            return torch.autograd.grad(out, (q, t), grad_out)

    return fallback
