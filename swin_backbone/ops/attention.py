"""Window multi-head self-attention with a relative position bias: the algorithm, the window
gathers, and the kernels that compute it.

:func:`reference_window_attention` is the algorithm in plain torch; :func:`window_attention`
computes the same between one gather into the window layout (:func:`window_partition`) and one
back to row-major order (the window reverse, its inverse), attending with the plan's kernel from
:data:`KERNELS` (SDPA's signature for all):

* ``sdpa``: SDPA with bias (+ mask) as a float mask, aligned (:func:`sdpa_ready`) so CUDA's
  memory-efficient kernel runs (it also gives the bias gradient).
* ``matmul``: matmul + softmax (attention dropout; TorchScript tracing, whose tools read matmuls).
* ``recompute``: CPU training: SDPA forward, hand-written backward (:class:`_RecomputedAttention`).

Around them a block runs two more things of its own, here beside the ops they wrap (as
torchvision keeps its ``StochasticDepth`` module in ``torchvision.ops``): :class:`DropPath`, the
stochastic depth of each residual branch, which reads the layout to drop a packed stage's images
one by one; and, in training, :data:`LEAN_SAVES`, which keeps the activations around the
attention lean: no LayerNorm, GELU or window-gather output is kept for backward where it can be
rebuilt from what autograd keeps anyway.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..torch_compat import is_compiling, scaled_dot_product_attention
from .layouts import WindowLayout, row_chunks, size_cache
from .windows import padded_size, relative_position_index, window_attention_mask


def reference_window_attention(
    x: torch.Tensor, qkv: nn.Linear, proj: nn.Linear, table: torch.Tensor, table_window: int, height: int, width: int,
    window: int, shift: int, num_heads: int, scale: float, mask_padding: bool = True,
) -> torch.Tensor:
    """(Shifted) window attention (Liu et al. 2021, section 3.2) written out: ``(B, H * W, C)``
    -> ``(B, H * W, C)``; ``table`` ``((2 tw - 1) ** 2, nH)``; ``mask_padding``: padding is its own region."""
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
    # 3. Scaled dot product + relative position bias; an additive mask between regions.
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


def sdpa_ready(bias: torch.Tensor, dtype: torch.dtype, align: bool) -> torch.Tensor:
    """``bias`` in ``dtype``; with ``align`` (CUDA) last stride 1 and rows 8-aligned (the
    memory-efficient kernel copies a misaligned mask on every call)."""
    bias = bias.to(dtype)
    n = bias.shape[-1]
    if not align or (bias.stride(-1) == 1 and all(st % 8 == 0 for st in bias.stride()[:-1])):
        return bias
    return F.pad(bias, (0, -n % 8)).narrow(-1, 0, n)


class _TokenGather(torch.autograd.Function):
    """``gather_tokens`` whose backward is a gather with ``inverse`` (a bijection on real
    tokens) instead of ``index_select``'s scatter-add, several times slower on CPU."""

    @staticmethod
    def forward(ctx, x, index, inverse, pad_slots, pad_in: bool, pad_out: bool):
        ctx.save_for_backward(inverse, pad_slots)
        ctx.pad_out = pad_out
        # (a function of x alone: lean_saves may rebuild the output from a rebuilt x)
        setattr(ctx, REBUILD_ATTR, lambda source: gather_tokens(source, index, pad_in, pad_slots))
        return gather_tokens(x, index, pad_in, pad_slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, pad_slots = ctx.saved_tensors
        return gather_tokens(grad, inverse, ctx.pad_out, pad_slots), None, None, None, None, None


def batch_rows(index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """``index`` into each of ``batch`` maps of ``length`` rows, as rows of the flattened
    ``(batch * length, C)``: ``(n,)`` -> ``(batch, n)``."""
    return index + torch.arange(0, batch * length, length, device=index.device)[:, None]


#: Cached :func:`batch_rows`, keyed by the (cached) layout tensor itself: an eager forward
#: launches no index arithmetic (on a GPU, where a training step waits on the host, two kernel
#: launches per gather); 64 entries hold a size's layouts in both directions at a few batch sizes.
get_batch_rows = size_cache(maxsize=64)(batch_rows)


def gather_tokens(x: torch.Tensor, index: torch.Tensor, pad: bool, pad_slots: Optional[torch.Tensor],
                  traceable: bool = False) -> torch.Tensor:
    """``(B, L, C)`` -> ``(B, len(index), C)``, zeros at the padding slots if ``pad``
    (``pad_slots``, or in the traceable form ``index == L``: a zero token is appended)."""
    if pad and pad_slots is None:
        return F.pad(x, (0, 0, 0, 1)).index_select(1, index)
    batch, length, channels = x.shape
    if traceable:
        out = x.index_select(1, index)
    else:
        # index_select along dim 1 is single-threaded on CPU; along dim 0 it is a parallel copy.
        rows = index if batch == 1 else (batch_rows if is_compiling() else get_batch_rows)(index, batch, length)
        flat = x.reshape(batch * length, channels)
        # (out=: torch 2.1's meta kernel sizes it wrongly; autograd records no out= op)
        if (torch.is_grad_enabled() and x.requires_grad) or x.device.type == "meta" or is_compiling():
            out = flat.index_select(0, rows.view(-1)).view(batch, -1, channels)
        else:  # into a tensor of its own, not a view (lean_saves rebuilds _TokenGather's output)
            out = x.new_empty(batch, index.numel(), channels)
            torch.index_select(flat, 0, rows.view(-1), out=out.view(-1, channels))
    return out.index_fill_(1, pad_slots, 0) if pad else out


def window_partition(x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """Pad, shift and partition in one gather: ``(B, H * W, C)`` -> ``(B, nW * N, C)`` (padding
    zeros); ``layout`` bound to the forward's plan (:func:`~.planner.stage_layouts`)."""
    plan = layout.plan
    if plan is None:
        raise ValueError("layout: expected a WindowLayout bound to a plan (ops.stage_layouts, or "
                         "dataclasses.replace(layout, plan=plan)), got one without")
    if layout.traceable or not plan.grad:
        return gather_tokens(x, layout.index, layout.has_padding, layout.pad_slots, layout.traceable)
    return _TokenGather.apply(x, layout.index, layout.inverse, layout.pad_slots, layout.has_padding, False)


def window_attention(
    qkv: torch.Tensor, table: torch.Tensor, layout: WindowLayout, *, num_heads: int, scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """:func:`reference_window_attention` between the projections, by the kernel of the layout's
    plan: ``qkv`` from :func:`window_partition` -> ``(B, H * W, C)`` row-major; ``table``
    ``((2 * tw - 1) ** 2, nH)`` for ``layout.table_window``; ``dropout_p``: attention dropout
    (the module's, in training). A packed layout (:func:`~.image_sizes.packed_layout`) runs the
    same way on its ``(1, T, 3C)`` tokens."""
    n = layout.window * layout.window
    bias = table.t().index_select(1, layout.bias_index).view(-1, n, n)  # (nH, N, N)
    kernel = layout.plan.attention
    if kernel == "recompute":  # (CPU training: SDPA's forward, a backward that gives the bias gradient)
        return _RecomputedAttention.apply(qkv, bias, layout, num_heads, scale)
    out = attention_in_windows(qkv, bias, layout.mask, layout.num_windows, num_heads, scale, dropout_p,
                               KERNELS[kernel], layout.align)
    # The window reverse: back to row-major tokens, the inverse gather of window_partition's.
    if layout.traceable or not layout.plan.grad:
        return gather_tokens(out, layout.inverse, False, None, layout.traceable)
    return _TokenGather.apply(out, layout.inverse, layout.index, layout.pad_slots, False, layout.has_padding)


#: What attends within a batch of windows: SDPA's signature, ``(q, k, v, *, attn_mask, dropout_p,
#: scale)`` -> attention output (:func:`_matmul`, or SDPA itself).
Attend = Callable[..., torch.Tensor]


def attention_in_windows(
    qkv: torch.Tensor, bias: torch.Tensor, mask: Optional[torch.Tensor], num_windows: int, num_heads: int,
    scale: float, dropout_p: float, run: Attend, align: bool = False,
) -> torch.Tensor:
    """Attention of every window with ``run``: ``(B, nW * N, 3C)`` -> ``(B, nW * N, C)``; ``bias``
    ``(nH, N, N)``; ``mask`` ``(nW, N, N)``, per image ``(B, nW, N, N)``, or ``None``.

    Without a mask the windows attend with the bias alone, broadcast over windows; with one,
    with per-window biases, their windows in the heads dimension (``(B, nW * nH, N, d)``, one
    copy) so the biases broadcast over the batch (or, per image, match it). One copy writes the
    result back in token order."""
    batch, tokens, three_c = qkv.shape
    n, head_dim = tokens // num_windows, three_c // (3 * num_heads)
    heads = qkv.view(batch, num_windows, n, 3, num_heads, head_dim).permute(3, 0, 1, 4, 2, 5)  # (3, B, nW, nH, N, d)
    if mask is None:
        q, k, v = heads.flatten(1, 2).unbind(0)
        # (4-d: CPU SDPA runs its fused kernel for a (1, nH, N, N) mask, its math one for (nH, N, N))
        attn_bias = sdpa_ready(bias, qkv.dtype, align).unsqueeze(0)
    else:
        # mask[..., None, :, :] + bias: (nW, nH, N, N), per image (B, nW, nH, N, N); with align a view
        # with 8-aligned rows made by one addition.
        mask, bias, pad = mask.to(qkv.dtype), bias.to(qkv.dtype), -n % 8 if align else 0
        if pad and mask.stride(-1) == 1 and mask.stride(-2) == n + pad:  # (a cached mask's aligned rows)
            mask = mask.as_strided(mask.shape[:-1] + (n + pad,), mask.stride())
        elif pad:
            mask = F.pad(mask, (0, pad))
        attn_bias = (mask.unsqueeze(-3) + F.pad(bias, (0, pad))).narrow(-1, 0, n)
        if batch == 1 and mask.dim() == 3:
            q, k, v = heads.flatten(1, 2).unbind(0)
        else:
            q, k, v = heads.reshape(3, batch, num_windows * num_heads, n, head_dim).unbind(0)
            images = mask.shape[0] if mask.dim() == 4 else 1
            attn_bias = attn_bias.reshape(images, num_windows * num_heads, n, n)
    out = run(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale)
    out = out.view(batch, -1, num_heads, n, head_dim).transpose(2, 3)  # (B, nW, N, nH, d)
    return out.reshape(batch, tokens, three_c // 3)


def _matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor, dropout_p: float,
            scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + attn_mask) v`` with matmuls (SDPA's signature)."""
    # In place on the fresh logits: no scaled copy of q kept, no second logits-sized temporary.
    attn = (q @ k.transpose(-2, -1)).mul_(scale).add_(attn_mask).softmax(dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v


class _RecomputedAttention(torch.autograd.Function):
    """Window attention + un-partition keeping only ``qkv`` and the output for backward: SDPA
    forward; backward recomputes ``P`` a cache-sized group of windows at a time
    (:func:`attention_backward`) and gives the bias gradient CPU SDPA cannot. Autograd's graph
    would keep ``P`` plus copies of q, k, v (about 1.5x ``qkv``)."""

    @staticmethod
    def forward(ctx, qkv, bias, layout: WindowLayout, num_heads: int, scale: float):
        # (No attention dropout: the planner runs "matmul" for it.)
        # Detached: CPU SDPA picks its slow math kernel for a mask that requires grad.
        out = attention_in_windows(qkv, bias.detach(), layout.mask, layout.num_windows, num_heads, scale, 0.0,
                                   scaled_dot_product_attention, layout.align)
        out = gather_tokens(out, layout.inverse, False, None)  # (B, H * W, C)
        ctx.save_for_backward(qkv, bias, out)
        ctx.num_heads, ctx.scale, ctx.layout = num_heads, scale, layout
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, bias, out = ctx.saved_tensors
        num_heads, scale, layout = ctx.num_heads, ctx.scale, ctx.layout
        num_windows, mask = layout.num_windows, layout.mask
        batch, tokens, three_c = qkv.shape
        n, head_dim, dtype = tokens // num_windows, three_c // (3 * num_heads), qkv.dtype
        acc = torch.promote_types(dtype, torch.float32)  # fp16 / bf16 reduce in fp32
        # dS = P * (dP - rowsum(P * dP)), rowsum(P * dP) = rowsum(dO * O): (B, H * W, nH) from the output.
        delta = (grad_out.to(acc) * out.to(acc)).view(batch, -1, num_heads, head_dim).sum(-1)
        # Back to the window layout; padding rows get zero gradient and a zero delta.
        to_windows = (layout.index, layout.has_padding, layout.pad_slots)
        grad_out = gather_tokens(grad_out, *to_windows).view(batch, num_windows, n, num_heads, head_dim)
        delta = gather_tokens(delta.to(dtype), *to_windows).view(batch, num_windows, n, num_heads)
        qkv = qkv.view(batch, num_windows, n, 3, num_heads, head_dim)
        grad_qkv = torch.empty_like(qkv)
        grad_bias = bias.new_zeros(bias.shape, dtype=acc) if ctx.needs_input_grad[1] else None
        bias_c, mask_c = bias.to(dtype), None if mask is None else mask.to(dtype)  # once, not per chunk
        # Windows a few at a time: the chunk's logits, probabilities and gradients stay in cache.
        window_bytes = batch * num_heads * n * n * qkv.element_size()
        for wins in row_chunks(num_windows, window_bytes, layout.plan.chunk_bytes // 2):
            attention_backward(qkv[:, wins], grad_out[:, wins], delta[:, wins], bias_c,
                               None if mask_c is None else mask_c[wins], scale, grad_qkv[:, wins], grad_bias)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_qkv.view(batch, tokens, three_c), grad_bias, None, None, None


def _split_heads(qkv: torch.Tensor, scale: float):
    """``(B, w, N, 3, nH, d)`` -> contiguous ``q * scale, k, v``, each ``(B, w, nH, N, d)``."""
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
    """Gradients of window attention for ``w`` windows, recomputing the probabilities: ``qkv``
    ``(B, w, N, 3, nH, d)``, ``grad_out`` ``(B, w, N, nH, d)``, ``delta`` ``(B, w, N, nH)``, ``bias``
    ``(nH, N, N)``, ``mask`` ``(w, N, N)``; writes ``grad_qkv``, accumulates fp32 ``grad_bias``."""
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


#: The attention of :func:`window_attention` by :attr:`Plan.attention <swin_backbone.ops.plan.Plan.attention>`
#: (``recompute``: SDPA, in :class:`_RecomputedAttention`).
KERNELS: Dict[str, Attend] = {"sdpa": scaled_dot_product_attention, "matmul": _matmul,
                              "recompute": scaled_dot_product_attention}


# ------------------------------------------------------------------------------ stochastic depth of a branch
class DropPath(nn.Module):
    """Stochastic depth: in training, zero a sample's branch with probability ``drop_prob`` and
    scale the rest by ``1 / (1 - drop_prob)`` (Huang et al. 2016; per sample, as timm's and
    torchvision's ``mode='row'``; drawn as mmcv's ``drop_path``). A packed layout's ``(1, T, C)``
    tokens are dropped image by image (:attr:`WindowLayout.image_tokens <.layouts.WindowLayout.image_tokens>`),
    each image a sample as it is alone."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor, layout: Optional[WindowLayout] = None) -> torch.Tensor:
        """``(B, ..., C)`` -> the same, each sample kept (and scaled) or zeroed."""
        # The rate read through __dict__: torch.compile then guards rate 0 apart from the others
        # and keeps the non-zero rates symbolic, one graph for them all (read as an attribute
        # after a rate-0 block, it guards each rate on its value: one graph per rate).
        if not self.training or self.__dict__["drop_prob"] == 0.0:
            return x
        if layout is not None and layout.image_tokens is not None:
            return torch.cat([drop_samples(image, self.drop_prob) for image in x.split(layout.image_tokens, 1)], 1)
        return drop_samples(x, self.drop_prob)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"


def drop_samples(x: torch.Tensor, drop_prob: float) -> torch.Tensor:
    """``x`` with each sample (dim 0) zeroed with probability ``drop_prob``, the rest scaled."""
    keep = 1.0 - drop_prob
    # mmcv's draw, floor(keep + U): mmdet's and mmseg's Swins drop the same samples from one
    # seed. Float arithmetic on the rate (not bernoulli_(p)) lets torch.compile keep it
    # symbolic: the blocks of a stage share one graph whatever their rates. Drawn in fp32
    # (a bf16 U keeps 0.8986 of the samples at keep = 0.9), then cast.
    noise = torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device)
    return x * noise.add_(keep).floor_().div_(keep).to(x.dtype)


# ------------------------------------------------------------------------------ activations kept for backward
#: Autograd nodes whose first output backward can rebuild from what the node itself keeps:
#: LayerNorm (from its input, mean and 1 / std) and GELU (from its input). Their outputs feed
#: linears (``qkv`` and ``fc1`` after a norm, ``fc2`` after GELU), which would keep them too.
_LAYER_NORM, _GELU = "NativeLayerNormBackward0", "GeluBackward0"

#: A dtype cast (autocast's, before a linear: on CUDA a LayerNorm computes and returns fp32 and
#: the linear keeps the bf16 copy): rebuilt as the cast of its rebuilt input.
_CAST = "ToCopyBackward0"

#: A custom autograd Function whose output is a function of its first input alone (the window
#: gather) says so by setting ``ctx.rebuild_output`` (that function): rebuilt where its input is.
REBUILD_ATTR = "rebuild_output"

#: What :data:`LEAN_SAVES` keeps in place of a rebuildable tensor: the node that made it (or its
#: base, for a view), the view's ``(size, stride, storage_offset)`` and the tensor's dtype.
_Rebuild = Tuple[torch.autograd.graph.Node, Optional[Tuple[torch.Size, Tuple[int, ...], int]], torch.dtype]


def _pack(t: torch.Tensor) -> Union[torch.Tensor, _Rebuild]:
    # The node's own output (or a view of it) as it left the op: an in-place change since would
    # have given it another node, so the node's inputs rebuild exactly what autograd would keep.
    base = t if t._base is None else t._base
    if base._base is not None or base.grad_fn is None or base.output_nr != 0:
        return t
    # The LayerNorm / GELU node it rebuilds from, through at most one cast and one gather of its first output.
    node, cast = base.grad_fn, False
    for _ in range(3):
        name = type(node).__name__
        if name in (_LAYER_NORM, _GELU):
            break
        if name != _CAST and not hasattr(node, REBUILD_ATTR):
            return t
        cast = cast or name == _CAST
        node, output_nr = node.next_functions[0]
        if node is None or output_nr != 0:
            return t
    else:
        return t
    if cast:  # (kept where the cast moved devices: it is rebuilt as a dtype change)
        kept = node._saved_self if type(node).__name__ == _GELU else node._saved_input
        if kept.device != t.device:
            return t
    return base.grad_fn, None if base is t else (t.size(), t.stride(), t.storage_offset()), t.dtype


def _rebuild(node: torch.autograd.graph.Node, dtype: torch.dtype) -> torch.Tensor:
    """``node``'s first output again (a cast's in ``dtype``, the dtype of what was kept)."""
    name = type(node).__name__
    if name == _GELU:
        return F.gelu(node._saved_self, approximate=node._saved_approximate)
    if name == _LAYER_NORM:  # (x - mean) / std * weight + bias, in the statistics' dtype (fp32 for half)
        x, mean, rstd = node._saved_input, node._saved_result1, node._saved_result2
        weight, bias = node._saved_weight, node._saved_bias
        out = (x.to(mean.dtype) - mean).mul_(rstd)
        if weight is not None and bias is not None:
            out = torch.addcmul(bias, out, weight)  # (one rounding, as torch's CPU kernel: the same bits)
        elif weight is not None:
            out = out.mul_(weight)
        elif bias is not None:
            out = out.add_(bias)
        return out.to(x.dtype)
    source = _rebuild(node.next_functions[0][0], dtype)
    return source.to(dtype) if name == _CAST else getattr(node, REBUILD_ATTR)(source)


def _unpack(saved: Union[torch.Tensor, _Rebuild]) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    node, view, dtype = saved
    out = _rebuild(node, dtype)
    return out if view is None else out.as_strided(*view)


#: The context a stage's blocks run in, by :attr:`Plan.save_memory <swin_backbone.ops.plan.Plan.save_memory>`
#: (``with LEAN_SAVES[plan.save_memory]:``, a value: no call per stage). Where true, autograd keeps
#: no LayerNorm or GELU output for backward.
#:
#: The linear after each (``qkv`` after a norm and the window gather, ``fc1`` after a norm,
#: ``fc2`` after GELU, a merging's reduction) would keep its input, or autocast's cast of it (CUDA
#: runs LayerNorm in fp32 and the linear in bf16); backward rebuilds it instead from what the
#: norm's or GELU's own node keeps anyway: pointwise, no module called again, no matmul. The
#: predicate is each tensor's own autograd node, so a hooked or replaced module's output, or a
#: tensor changed in place, is kept as usual. Where false: nothing changes. (Both contexts hold
#: no state: one of each serves every stage, nested or in any thread.)
LEAN_SAVES: Dict[bool, ContextManager[None]] = {
    False: contextlib.nullcontext(),
    True: torch.autograd.graph.saved_tensors_hooks(_pack, _unpack),
}
