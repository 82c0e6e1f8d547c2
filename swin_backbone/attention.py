"""Window multi-head self-attention with a relative position bias.

The whole algorithm is the pure function :func:`window_attention`; :class:`WindowAttention`
only owns the weights. Two interchangeable kernels compute it:

* fused: ``F.scaled_dot_product_attention`` with the bias (+ mask) as an additive float mask;
* plain: ``softmax(q @ k^T * scale + bias) @ v``.

On CPU the fused kernel is only fast when the mask does not require grad (else torch silently
falls back to its slow math kernel, see shared/PERFORMANCE.md), so in training the plain path
is used there. On CUDA the memory-efficient kernel takes a float mask with grad, so the fused
path is always used. Both give the same numbers (tested).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .windows import WindowLayout, get_relative_position_index


def choose_fused(q: torch.Tensor, attn_bias: torch.Tensor) -> bool:
    """Whether the fused SDPA kernel is exact *and* fast for these inputs."""
    if q.device.type == "cuda":
        return True
    return not (torch.is_grad_enabled() and attn_bias.requires_grad)


def window_attention(
    qkv: torch.Tensor,
    num_heads: int,
    num_windows: int,
    bias: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    dropout_p: float = 0.0,
    fused: Optional[bool] = None,
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
        fused: force the fused (True) or plain (False) kernel; ``None`` picks by
            :func:`choose_fused`.
        masked_windows, window_masks: ``(nM,)`` windows whose mask is not all zero and their
            ``(nM, N, N)`` masks. When given, every window is computed with the shared bias
            only and these few windows are recomputed with their masks, instead of
            materialising an ``(nW, nH, N, N)`` bias (and its gradient) for all windows.
    Returns:
        ``(B, nW * N, C)`` attention output, before the output projection.
    """
    batch, tokens, three_c = qkv.shape
    n = tokens // num_windows
    head_dim = three_c // (3 * num_heads)
    # (B, nW, N, 3, nH, d) -> (3, B, nW, nH, N, d): a view, no copy.
    qkv = qkv.view(batch, num_windows, n, 3, num_heads, head_dim).permute(3, 0, 1, 4, 2, 5)
    shared = bias.unsqueeze(0).to(qkv.dtype)  # (1, nH, N, N)
    if fused is None:
        fused = choose_fused(qkv, shared)
    kernel = _fused if fused else _plain
    if mask is None or masked_windows is not None:
        out = kernel(qkv, shared, False, scale, dropout_p)  # (B, nW, N, nH, d)
        if mask is not None and masked_windows.numel():
            fix = (window_masks.unsqueeze(1) + bias.unsqueeze(0)).to(qkv.dtype)
            fixed = kernel(qkv.index_select(2, masked_windows), fix, True, scale, dropout_p)
            # In place when nothing needs the old values (SDPA keeps its output for backward).
            out = out.index_copy_(1, masked_windows, fixed) if not out.requires_grad else out.index_copy(
                1, masked_windows, fixed
            )
    else:
        attn_bias = (mask.unsqueeze(1) + bias.unsqueeze(0)).to(qkv.dtype)  # (nW, nH, N, N)
        out = kernel(qkv, attn_bias, True, scale, dropout_p)
    return out.reshape(batch, tokens, num_heads * head_dim)


def _fused(qkv: torch.Tensor, attn_bias: torch.Tensor, per_window: bool, scale: float, dropout_p: float) -> torch.Tensor:
    """SDPA on strided views of ``qkv`` ``(3, B, nW, nH, N, d)``.

    The kernels read q/k/v through their strides and write the output as ``(B*nW, N, nH, d)``
    memory, so neither the inputs nor the output are copied. Returns ``(B, nW, N, nH, d)``.
    """
    _, batch, num_windows, num_heads, n, head_dim = qkv.shape
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


class WindowAttention(nn.Module):
    """Weights of window attention: qkv / output projections and the bias table.

    Args:
        embed_dims: channels ``C``.
        num_heads: heads ``nH`` (must divide ``C``).
        window_size: window the bias table is sized for (``(2 * ws - 1) ** 2`` rows).
        qkv_bias: learnable bias in the qkv projection.
        qk_scale: query scale; ``None`` means ``head_dim ** -0.5``.
        attn_drop_rate: dropout on attention weights.
        proj_drop_rate: dropout after the output projection.
    """

    def __init__(
        self,
        embed_dims: int,
        num_heads: int,
        window_size: int,
        qkv_bias: bool = True,
        qk_scale: Optional[float] = None,
        attn_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.window_size = window_size
        self.scale = qk_scale or (embed_dims // num_heads) ** -0.5
        self.attn_drop_rate = attn_drop_rate
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window_size - 1) ** 2, num_heads)
        )
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop_rate)

    def relative_position_bias(self, window: int) -> torch.Tensor:
        """``(nH, N, N)`` bias for a ``window x window`` window (``window <= window_size``)."""
        table = self.relative_position_bias_table
        index = get_relative_position_index(window, self.window_size, table.device)
        n = window * window
        return table[index].view(n, n, self.num_heads).permute(2, 0, 1)

    def forward(self, x: torch.Tensor, layout: WindowLayout, fused: Optional[bool] = None) -> torch.Tensor:
        """``(B, nW * N, C)`` window-layout tokens -> same shape."""
        out = window_attention(
            self.qkv(x),
            self.num_heads,
            layout.num_windows,
            self.relative_position_bias(layout.window),
            layout.mask,
            self.scale,
            self.attn_drop_rate if self.training else 0.0,
            fused,
            layout.masked_windows,
            layout.window_masks,
        )
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, window_size={self.window_size}"
