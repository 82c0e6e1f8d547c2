"""Window attention's weights: qkv / output projections and the relative position bias table."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import ops


class WindowAttention(nn.Module):
    """(Shifted) window multi-head self-attention with a relative position bias (W-MSA / SW-MSA).

    Args:
        embed_dims: channels ``C``, in ``num_heads`` heads ``nH`` (which must divide ``C``).
        window_size: window the bias table is sized for (``(2 * ws - 1) ** 2`` rows).
        qk_scale: query scale; ``None`` means ``head_dim ** -0.5``.
        attn_drop_rate, proj_drop_rate: dropout on attention weights, after the output projection.
    """

    def __init__(self, embed_dims: int, num_heads: int, window_size: int, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, attn_drop_rate: float = 0.0, proj_drop_rate: float = 0.0) -> None:
        super().__init__()
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.window_size = window_size
        self.scale = qk_scale or (embed_dims // num_heads) ** -0.5
        self.attn_drop_rate = attn_drop_rate
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window_size - 1) ** 2, num_heads))
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop_rate)

    def forward(self, x: torch.Tensor, norm: nn.Module, layout: ops.WindowLayout, plan: ops.Plan) -> torch.Tensor:
        """``proj(attention(qkv(windows(norm(x)))))``: ``(B, H * W, C)`` -> ``(B, H * W, C)``.

        The tokens are normalised by the block's ``norm``, padded, shifted and cut into
        ``layout``'s windows (one gather), projected to q, k, v, attend within their window (a
        bias per relative offset, a mask between shift regions and padding), and return to
        row-major order before the output projection, which thus runs on real tokens only.
        ``plan``: the stage's (:func:`swin_backbone.ops.plan_forward`, ``Plan.for_stage``).
        """
        qkv = ops.checkpointed(self.qkv_windows, plan, x, norm, layout)
        out = ops.window_attention(qkv, self.relative_position_bias_table, layout, plan, num_heads=self.num_heads,
                                   scale=self.scale, dropout_p=self.attn_drop_rate)
        return self.proj_drop(self.proj(out))

    def qkv_windows(self, x: torch.Tensor, norm: nn.Module, layout: ops.WindowLayout, plan: ops.Plan) -> torch.Tensor:
        """``qkv(windows(norm(x)))``: ``(B, H * W, C)`` -> ``(B, nW * N, 3C)`` (the plan's kernel
        may read row-major tokens: :func:`swin_backbone.ops.window_partition`)."""
        return self.qkv(ops.window_partition(norm(x), layout, plan))

    def extra_repr(self) -> str:
        return f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, window_size={self.window_size}"
