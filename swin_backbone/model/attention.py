"""Window attention's weights: qkv / output projections and the relative position bias table."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.attention import _project, attention_to_tokens
from ..ops.windows import WindowLayout, get_relative_position_index


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

    def forward(self, x: torch.Tensor, layout: WindowLayout, kernel: Optional[str] = None) -> torch.Tensor:
        """``(B, nW * N, C)`` window-layout tokens -> ``(B, H * W, C)`` row-major tokens."""
        return self.attend(self.qkv(x), layout, kernel)

    def attend(self, qkv: torch.Tensor, layout: WindowLayout, kernel: Optional[str] = None) -> torch.Tensor:
        """``(B, nW * N, 3C)`` projected window tokens -> ``(B, H * W, C)`` after the output
        projection (which runs on the real tokens only)."""
        out = attention_to_tokens(
            qkv,
            self.num_heads,
            self.relative_position_bias(layout.window),
            layout,
            self.scale,
            self.attn_drop_rate if self.training else 0.0,
            kernel,
        )
        return self.proj_drop(_project(out, self.proj))

    def extra_repr(self) -> str:
        return f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, window_size={self.window_size}"
