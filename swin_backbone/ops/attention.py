"""Window multi-head self-attention with a relative position bias.

The whole algorithm is the pure function :func:`window_attention`; :class:`WindowAttention`
only owns the weights. Three interchangeable kernels compute it:

* ``fused``: ``F.scaled_dot_product_attention`` with the bias (+ mask) as an additive float mask;
* ``plain``: ``softmax(q @ k^T * scale + bias) @ v`` with autograd's own graph;
* ``recompute``: the fused forward, and a hand-written backward that recomputes the attention
  probabilities from ``qkv`` (:class:`_RecomputedAttention`; layers small enough compute the
  probabilities with matmuls and keep them instead).

On CPU the fused kernel is only fast when the mask does not require grad (else torch silently
falls back to its slow math kernel, see shared/PERFORMANCE.md), and its backward gives no bias
gradient, so CPU training uses ``recompute``: SDPA speed forward, and only ``qkv`` kept for
backward. ``plain`` remains for attention dropout and for ``torch.compile`` (inductor fuses
it). On CUDA the memory-efficient kernel takes a float mask with grad, so ``fused`` is always
used. All give the same numbers (tested).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import chunked
from .chunked import grad_needed
from .windows import WindowLayout, get_relative_position_index, window_reverse


KERNELS = ("fused", "plain", "recompute")

#: Largest share of windows with a non-zero mask for which :func:`window_attention` computes
#: all windows with the shared bias and recomputes the masked ones; above it, one per-window
#: bias for all windows is faster. Measured on CPU inside whole forwards (SDPA): stages 3-4
#: (32-89% masked) run 7-30% faster per-window; stage 1 of a 2 x 512 x 512 batch (20%) and
#: stage 2 at 800 x 1216 (11-17%) run slower (their per-window biases are 10-18 MB).
RECOMPUTE_MASKED_SHARE = 0.25


def choose_kernel(q: torch.Tensor, attn_bias: torch.Tensor, dropout_p: float = 0.0) -> str:
    """The fastest exact kernel for these inputs (see the module docstring)."""
    if q.device.type == "cuda":
        return "fused"  # memory-efficient SDPA computes the bias gradient itself
    if not grad_needed(q, attn_bias):
        return "fused"
    if dropout_p > 0 or torch.compiler.is_compiling():
        return "plain"  # autograd's own graph (dropout masks; traceable for inductor)
    return "recompute"


def window_attention(
    qkv: torch.Tensor,
    num_heads: int,
    num_windows: int,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    dropout_p: float = 0.0,
    kernel: Optional[str] = None,
    masked_windows: Optional[torch.Tensor] = None,
    window_masks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Multi-head attention inside each window.

    Args:
        qkv: ``(B, nW * N, 3 * C)`` projected queries, keys and values in window layout.
        num_heads: ``nH``; ``C`` must be divisible by it.
        num_windows: ``nW``.
        bias: ``(nH, N, N)`` relative position bias.
        mask: ``(nW, N, N)`` additive region mask, or ``None``.
        scale: query scale (``head_dim ** -0.5`` by default).
        dropout_p: attention dropout probability (pass 0 in eval).
        kernel: ``"fused"`` or ``"plain"`` (see the module docstring); ``None`` picks by
            :func:`choose_kernel` (``"recompute"`` is :func:`attention_to_tokens`'s).
        masked_windows, window_masks: ``(nM,)`` windows whose mask is not all zero and their
            ``(nM, N, N)`` masks. When given and few (:data:`RECOMPUTE_MASKED_SHARE`), every
            window is computed with the shared bias only and these windows are recomputed
            with their masks, instead of materialising an ``(nW, nH, N, N)`` bias (and its
            gradient) for all windows.
    Returns:
        ``(B, nW * N, C)`` attention output, before the output projection.
    """
    if kernel is None:
        kernel = choose_kernel(qkv, bias, dropout_p)
    if kernel not in ("fused", "plain"):
        raise ValueError(f"kernel must be 'fused', 'plain' or None here, got {kernel!r} (see attention_to_tokens)")
    batch, tokens, three_c = qkv.shape
    n = tokens // num_windows
    head_dim = three_c // (3 * num_heads)
    # (B, nW, N, 3, nH, d) -> (3, B, nW, nH, N, d): a view, no copy.
    qkv = qkv.view(batch, num_windows, n, 3, num_heads, head_dim).permute(3, 0, 1, 4, 2, 5)
    shared = bias.unsqueeze(0).to(qkv.dtype)  # (1, nH, N, N)
    run = _fused if kernel == "fused" else _plain
    few_masked = masked_windows is not None and masked_windows.numel() <= RECOMPUTE_MASKED_SHARE * num_windows
    if mask is None or few_masked:
        out = run(qkv, shared, False, scale, dropout_p)  # (B, nW, N, nH, d)
        if mask is not None and masked_windows.numel():
            fix = (window_masks.unsqueeze(1) + bias.unsqueeze(0)).to(qkv.dtype)
            fixed = run(qkv.index_select(2, masked_windows), fix, True, scale, dropout_p)
            # In place when nothing needs the old values (SDPA keeps its output for backward).
            out = out.index_copy_(1, masked_windows, fixed) if not out.requires_grad else out.index_copy(
                1, masked_windows, fixed
            )
    else:
        attn_bias = (mask.unsqueeze(1) + bias.unsqueeze(0)).to(qkv.dtype)  # (nW, nH, N, N)
        out = run(qkv, attn_bias, True, scale, dropout_p)
    return out.reshape(batch, tokens, num_heads * head_dim)


def attention_to_tokens(
    qkv: torch.Tensor,
    num_heads: int,
    bias: torch.Tensor,
    layout: WindowLayout,
    scale: float,
    dropout_p: float = 0.0,
    kernel: Optional[str] = None,
) -> torch.Tensor:
    """:func:`window_attention` over ``layout``, returned in row-major token order.

    The tokens leave the window layout before the output projection, so the projection runs
    on real tokens only, not on the padding that fills the last windows.

    Args:
        qkv: ``(B, nW * N, 3 * C)`` in ``layout``'s window order.
        kernel: one of :data:`KERNELS`, or ``None`` for :func:`choose_kernel`'s choice.
    Returns:
        ``(B, H * W, C)``.
    """
    if kernel is None:
        kernel = choose_kernel(qkv, bias, dropout_p)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    if kernel == "recompute":
        if dropout_p > 0:
            raise ValueError(f"kernel='recompute' has no attention dropout, got dropout_p={dropout_p}")
        return _RecomputedAttention.apply(qkv, bias, num_heads, scale, layout)
    return window_reverse(_in_layout(qkv, num_heads, bias, layout, scale, dropout_p, kernel), layout)


def _in_layout(qkv, num_heads: int, bias, layout: WindowLayout, scale: float, dropout_p: float, kernel: str):
    """:func:`window_attention` with the windows, mask and masked windows of ``layout``."""
    return window_attention(
        qkv, num_heads, layout.num_windows, bias, layout.mask, scale, dropout_p, kernel,
        layout.masked_windows, layout.window_masks,
    )


#: Attention probabilities of a whole layer up to this size are kept for backward instead
#: of recomputed (CPU training; stages 2-4 of a 2 x 512 x 512 batch: 4-11 MiB each). The
#: forward then computes them with matmuls, as fast there as SDPA, and the backward skips
#: the recomputation (in situ: stage-2 backward 60 -> 42 ms, stage 3 101 -> 77 ms). Costs at
#: most this much more memory per block (66 MiB in all at 2 x 512 x 512).
KEEP_PROBS_BYTES = 12 * 2**20


class _RecomputedAttention(torch.autograd.Function):
    """Window attention + un-partition that keeps only ``qkv`` (and its output) for backward.

    Forward is the fused SDPA kernel (fast on CPU, no ``(..., N, N)`` tensor kept). Backward
    recomputes ``P = softmax(q k^T * scale + bias + mask)`` and applies the softmax gradient by
    hand (:func:`attention_backward`, a cache-sized group of windows at a time on CPU), which
    also yields the bias gradient that CPU SDPA cannot give. Autograd's own graph
    would keep ``P`` plus contiguous copies of ``q``, ``k`` and ``v`` (about 1.5x ``qkv``).
    The output is kept by the next linear layer anyway, so saving it here costs nothing.
    Small layers (:data:`KEEP_PROBS_BYTES`) keep ``P`` itself instead of recomputing it.
    """

    @staticmethod
    def forward(ctx, qkv, bias, num_heads: int, scale: float, layout: WindowLayout):
        windows = _windows(qkv, num_heads, layout)  # (B, nW, N, 3, nH, d)
        batch, num_windows, n = windows.shape[:3]
        probs = None
        if batch * num_windows * num_heads * n * n * qkv.element_size() <= KEEP_PROBS_BYTES:
            mask = None if layout.mask is None else layout.mask.to(qkv.dtype)
            q, k, v = _split_heads(windows, scale)
            probs = _probs(q, k, bias.to(qkv.dtype), mask)
            out = torch.matmul(probs, v).transpose(2, 3).reshape(batch, num_windows * n, -1)
        else:
            out = _in_layout(qkv, num_heads, bias, layout, scale, 0.0, "fused")
        out = layout.to_tokens(out)  # (B, H * W, C)
        ctx.save_for_backward(qkv, bias, out, probs)
        ctx.num_heads, ctx.scale, ctx.layout = num_heads, scale, layout
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, bias, out, probs = ctx.saved_tensors
        num_heads, scale, layout = ctx.num_heads, ctx.scale, ctx.layout
        num_windows, mask = layout.num_windows, layout.mask
        batch, tokens, three_c = qkv.shape
        n, head_dim, dtype = tokens // num_windows, three_c // (3 * num_heads), qkv.dtype
        acc = torch.promote_types(dtype, torch.float32)  # fp16 / bf16 reduce in fp32
        # Softmax backward: dS = P * (dP - rowsum(P * dP)), and rowsum(P * dP) = rowsum(dO * O)
        # per query and head: a (B, H * W, nH) term read off the output (row-major tokens)
        # instead of the N x N logits.
        delta = (grad_out.to(acc) * out.to(acc)).view(batch, -1, num_heads, head_dim).sum(-1)
        # Back to the window layout; padding rows get zero gradient and a zero delta.
        grad_out, delta = layout.to_windows(grad_out), layout.to_windows(delta.to(dtype))
        grad_out = grad_out.view(batch, num_windows, n, num_heads, head_dim)
        delta = delta.view(batch, num_windows, n, num_heads)
        qkv = _windows(qkv, num_heads, layout)
        grad_qkv = torch.empty_like(qkv)
        grad_bias = bias.new_zeros(bias.shape, dtype=acc) if ctx.needs_input_grad[1] else None
        bias_c, mask_c = bias.to(dtype), None if mask is None else mask.to(dtype)  # once, not per chunk
        # Windows a few at a time: the chunk's logits, probabilities and gradients stay in cache.
        step = num_windows
        if qkv.device.type == "cpu" and probs is None:
            step = chunked.chunk_rows(batch * num_heads * n * n, qkv.element_size(), chunked.ATTENTION_CHUNK_BYTES)
        for part in chunked.chunk_slices(num_windows, step):
            attention_backward(
                qkv[:, part], grad_out[:, part], delta[:, part], bias_c,
                None if mask_c is None else mask_c[part], scale, grad_qkv[:, part], grad_bias,
                None if probs is None else probs[:, part],
            )
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_qkv.view(batch, tokens, three_c), grad_bias, None, None, None


def _windows(qkv: torch.Tensor, num_heads: int, layout: WindowLayout) -> torch.Tensor:
    """``(B, nW * N, 3C)`` -> a ``(B, nW, N, 3, nH, d)`` view."""
    batch, tokens, three_c = qkv.shape
    n = tokens // layout.num_windows
    return qkv.view(batch, layout.num_windows, n, 3, num_heads, three_c // (3 * num_heads))


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
    qkv: torch.Tensor,
    grad_out: torch.Tensor,
    delta: torch.Tensor,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    grad_qkv: torch.Tensor,
    grad_bias: Optional[torch.Tensor],
    probs: Optional[torch.Tensor] = None,
) -> None:
    """Gradients of window attention for some windows, recomputing the probabilities unless
    given.

    Args:
        qkv: ``(B, w, N, 3, nH, d)`` queries, keys and values of ``w`` windows (a view).
        grad_out: ``(B, w, N, nH, d)`` gradient of the attention output.
        delta: ``(B, w, N, nH)`` ``rowsum(grad_out * out)`` per query and head.
        bias: ``(nH, N, N)``; mask: ``(w, N, N)`` or None; both in ``qkv``'s dtype.
        grad_qkv: ``(B, w, N, 3, nH, d)`` written with the gradient of ``qkv``.
        grad_bias: ``(nH, N, N)`` in fp32 or wider, accumulated into; None to skip.
        probs: ``(B, w, nH, N, N)`` attention probabilities kept by the forward, or None.
    """
    dtype = qkv.dtype
    acc = torch.promote_types(dtype, torch.float32)
    q, k, v = _split_heads(qkv, scale)
    if probs is None:
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


def _fused(qkv: torch.Tensor, attn_bias: torch.Tensor, per_window: bool, scale: float, dropout_p: float) -> torch.Tensor:
    """SDPA on strided views of ``qkv`` ``(3, B, nW, nH, N, d)``.

    The kernels read q/k/v through their strides and write the output as ``(B*nW, N, nH, d)``
    memory, so neither the inputs nor the output are copied. Returns ``(B, nW, N, nH, d)``.
    """
    _, batch, num_windows, num_heads, n, head_dim = qkv.shape
    if not torch.is_grad_enabled():
        # CPU SDPA picks its slow math kernel for a mask that requires grad, even under
        # no_grad (as inside _RecomputedAttention.forward), where no gradient can flow anyway.
        attn_bias = attn_bias.detach()
    if not per_window or batch == 1:
        # One bias for all windows, or one image: windows go into SDPA's batch dimension.
        q, k, v = qkv.flatten(1, 2).unbind(0)  # (B * nW, nH, N, d) views
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale)
        # CPU and CUDA kernels allocate the output as (B*nW, N, nH, d): reshape is then a view.
        return out.transpose(1, 2).reshape(batch, num_windows, n, num_heads, head_dim)
    # Per-window masks and several images: one call per image reuses the (nW, nH, N, N)
    # mask instead of materialising a B-times larger one.
    outs = [
        F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale).transpose(1, 2)
        for q, k, v in zip(*qkv.unbind(0))
    ]
    return torch.stack(outs)


def _plain(qkv: torch.Tensor, attn_bias: torch.Tensor, per_window: bool, scale: float, dropout_p: float) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v`` with matmuls. Returns ``(B, nW, N, nH, d)``.

    With per-window masks, windows are folded into the heads dimension,
    ``(B, nW * nH, N, d)``, so one ``(1, nW * nH, N, N)`` bias broadcasts over the batch;
    with one bias for all windows, windows go into the batch dimension.
    """
    _, batch, num_windows, num_heads, n, head_dim = qkv.shape
    if not per_window:
        q, k, v = qkv.reshape(3, batch * num_windows, num_heads, n, head_dim).unbind(0)
    else:
        q, k, v = qkv.reshape(3, batch, num_windows * num_heads, n, head_dim).unbind(0)
        attn_bias = attn_bias.reshape(1, num_windows * num_heads, n, n)
    # Scale and bias in place on the fresh logits: nothing extra is kept for backward (a
    # scaled copy of q would be), and no second logits-sized temporary is made.
    attn = (q @ k.transpose(-2, -1)).mul_(scale).add_(attn_bias).softmax(dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    out = attn @ v
    return out.view(batch, num_windows, num_heads, n, head_dim).transpose(2, 3)


def _project(tokens: torch.Tensor, linear: nn.Module) -> torch.Tensor:
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
