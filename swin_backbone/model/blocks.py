"""Building blocks: patch embedding, Swin block, patch merging, stage.

Feature maps travel between modules as channels-last ``(B, H, W, C)`` tensors; inside a
stage the blocks work on the flat ``(B, H * W, C)`` view of the same memory.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn
from torchvision.ops import StochasticDepth

from .attention import WindowAttention
from ..ops.chunked import grad_needed, mlp_residual_
from ..ops.recompute import norm_linear, norm_mlp
from ..ops.windows import (
    WindowLayout,
    ceil_div,
    effective_window,
    get_window_layout,
    pad_amount,
    window_partition,
)


class PatchEmbed(nn.Module):
    """Non-overlapping patch embedding; pads bottom/right to a multiple of the patch size.

    ``(B, C_in, H, W)`` -> ``(B, ceil(H / p), ceil(W / p), C)``.
    """

    def __init__(self, in_channels: int, embed_dims: int, patch_size: int, norm: bool = True) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, embed_dims, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dims) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        x = F.pad(x, (0, pad_amount(x.shape[-1], p), 0, pad_amount(x.shape[-2], p)))
        # A channels-last input makes the convolution write channels-last, so the permute
        # below is a view: no transposing copy of the largest feature map (~2x faster).
        x = self.proj(x.contiguous(memory_format=torch.channels_last))
        return self.norm(x.permute(0, 2, 3, 1))


class Mlp(nn.Module):
    """Two-layer feed-forward network (``fc1 -> GELU -> drop -> fc2 -> drop``).

    In training without dropout it keeps only its input (and ``fc1``'s output) for backward
    (:func:`~swin_backbone.ops.recompute.norm_mlp`); the numbers are the same.
    """

    def __init__(self, embed_dims: int, hidden_dims: int, drop_rate: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, hidden_dims)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dims, embed_dims)
        self.drop = nn.Dropout(drop_rate)

    def forward(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``(..., C)`` -> ``(..., C)``, applying ``norm`` to the input first if given."""
        if self.drop.p == 0:
            return norm_mlp(x, norm, self.fc1, self.fc2)
        x = x if norm is None else norm(x)
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


#: ``padding share x C`` above which :func:`project_before_partition` projects first.
PROJECT_FIRST_BREAK_EVEN = 48


def project_before_partition(layout: WindowLayout, channels: int) -> bool:
    """Whether to run the qkv projection on the real tokens and partition its output.

    Exact only when padding is masked (the padding rows then hold zeros instead of the qkv
    bias, and no real token can see them). It saves the projection of the padding tokens
    (3C x C multiply-adds each) for a 3x wider gather (3C instead of C values per token):
    worth it where padding is a large share of the map and C is large (stages 3 and 4 of
    detection-sized inputs). Measured break-even on CPU: ``padding share x C ~ 48``.
    """
    if torch.compiler.is_compiling() or not layout.has_padding or not layout.padding_masked:
        return False
    real = layout.height * layout.width
    return (layout.index.numel() - real) * channels >= PROJECT_FIRST_BREAK_EVEN * real


class SwinBlock(nn.Module):
    """Pre-norm (shifted-)window attention + MLP, each with a residual and stochastic depth.

    The block itself holds no size-dependent state: the stage hands it a
    :class:`~swin_backbone.ops.windows.WindowLayout` with the gather indices and mask.
    """

    def __init__(
        self,
        embed_dims: int,
        num_heads: int,
        window_size: int,
        shift: bool,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_scale: Optional[float] = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.shift = shift
        self.norm1 = nn.LayerNorm(embed_dims)
        self.attn = WindowAttention(
            embed_dims, num_heads, window_size, qkv_bias, qk_scale, attn_drop_rate, drop_rate
        )
        self.drop_path = StochasticDepth(drop_path_rate, mode="row")
        self.norm2 = nn.LayerNorm(embed_dims)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop_rate)

    def forward(self, x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
        """``(B, H * W, C)`` -> ``(B, H * W, C)``."""
        # norm -> partition -> qkv and norm -> MLP keep only x (and h) for backward (recompute.py).
        if project_before_partition(layout, x.shape[-1]):
            qkv = window_partition(norm_linear(x, self.norm1, self.attn.qkv), layout)
        else:
            qkv = norm_linear(x, self.norm1, self.attn.qkv, layout)  # (B, nW * N, 3C)
        # Residuals are added into the branch's fresh output (x + y == y + x exactly): no new
        # map-sized tensor, whose pages the OS would have to supply.
        x = self.drop_path(self.attn.attend(qkv, layout)).add_(x)
        if self._mlp_in_chunks(x):
            return mlp_residual_(x, self.norm2, self.mlp.fc1, self.mlp.fc2)  # x is ours: in place
        return self.drop_path(self.mlp(x, self.norm2)).add_(x)

    def _mlp_in_chunks(self, x: torch.Tensor) -> bool:
        """CPU inference without dropout / stochastic depth: the row-chunked MLP (chunked.py).

        Chunking is a CPU cache optimisation; on GPUs it would only multiply kernel launches.
        """
        if x.device.type != "cpu" or torch.compiler.is_compiling() or self.mlp.drop.p > 0:
            return False
        if self.training and self.drop_path.p > 0:
            return False
        return not grad_needed(x, self.norm2.weight, self.mlp.fc1.weight, self.mlp.fc2.weight)


class PatchMerging(nn.Module):
    """2x2 neighbourhood concatenation + LayerNorm + linear reduction ``4C -> 2C``.

    Odd sizes are padded bottom/right with zeros first. Channels are concatenated in the
    official order ``x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]`` (as timm
    and torchvision); mmdet's nn.Unfold order is converted when its weights are loaded.
    ``(B, H, W, C)`` -> ``(B, ceil(H / 2), ceil(W / 2), 2C)``.
    """

    def __init__(self, embed_dims: int, out_dims: Optional[int] = None, norm: bool = True) -> None:
        super().__init__()
        out_dims = out_dims or 2 * embed_dims
        self.norm = nn.LayerNorm(4 * embed_dims) if norm else nn.Identity()
        self.reduction = nn.Linear(4 * embed_dims, out_dims, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        h2, w2 = ceil_div(h, 2), ceil_div(w, 2)
        x = F.pad(x, (0, 0, 0, 2 * w2 - w, 0, 2 * h2 - h))
        # (B, h, dh, w, dw, C) -> (B, h, w, dw, dh, C): channel block k = 2 * dw + dh.
        x = x.view(b, h2, 2, w2, 2, c).permute(0, 1, 3, 4, 2, 5).reshape(b, h2, w2, 4 * c)
        return norm_linear(x, self.norm, self.reduction)


class SwinStage(nn.Module):
    """``depth`` Swin blocks (every second one shifted) and an optional patch merging.

    Args:
        embed_dims, num_heads, window_size, mlp_ratio, qkv_bias, qk_scale, drop_rate,
            attn_drop_rate: as in :class:`SwinBlock`.
        depth: number of blocks.
        drop_path_rates: one stochastic-depth rate per block.
        downsample: append a :class:`PatchMerging`.
        patch_norm: LayerNorm inside the patch merging.
        pad_small_map, mask_padding: see :class:`~swin_backbone.SwinBackbone`.
        with_cp: non-reentrant activation checkpointing per block.
    """

    def __init__(
        self,
        embed_dims: int,
        depth: int,
        num_heads: int,
        window_size: int,
        drop_path_rates: Sequence[float],
        downsample: bool,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_scale: Optional[float] = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        patch_norm: bool = True,
        pad_small_map: bool = True,
        mask_padding: bool = True,
        with_cp: bool = False,
    ) -> None:
        super().__init__()
        self.window_size = window_size
        self.shift_size = window_size // 2
        self.pad_small_map = pad_small_map
        self.mask_padding = mask_padding
        self.with_cp = with_cp
        self.blocks = nn.ModuleList(
            SwinBlock(
                embed_dims,
                num_heads,
                window_size,
                shift=i % 2 == 1,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                qk_scale=qk_scale,
                drop_rate=drop_rate,
                attn_drop_rate=attn_drop_rate,
                drop_path_rate=drop_path_rates[i],
            )
            for i in range(depth)
        )
        self.downsample = PatchMerging(embed_dims, norm=patch_norm) if downsample else None

    def layouts(self, height: int, width: int, x: torch.Tensor) -> Tuple[WindowLayout, WindowLayout]:
        """The (regular, shifted) window layouts for an ``height x width`` map (cached)."""
        window, shift = effective_window(height, width, self.window_size, self.shift_size, self.pad_small_map)
        regular = get_window_layout(height, width, window, 0, self.mask_padding, x.device, x.dtype)
        if shift == 0:
            return regular, regular
        return regular, get_window_layout(height, width, window, shift, self.mask_padding, x.device, x.dtype)

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)`` through the blocks (no merging)."""
        b, h, w, c = x.shape
        layouts = self.layouts(h, w, x)
        tokens = x.reshape(b, h * w, c)
        for block in self.blocks:
            layout = layouts[int(block.shift)]
            if self.with_cp and self.training and tokens.requires_grad:
                tokens = checkpoint.checkpoint(block, tokens, layout, use_reentrant=False)
            else:
                tokens = block(tokens, layout)
        return tokens.view(b, h, w, c)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(stage output (B, H, W, C), merged (B, H/2, W/2, 2C) or the output)``."""
        out = self.forward_blocks(x)
        return out, (self.downsample(out) if self.downsample is not None else out)
