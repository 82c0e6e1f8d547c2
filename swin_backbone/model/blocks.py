"""Building blocks: patch embedding, window attention, Swin block, patch merging, stage.

Feature maps travel between modules as channels-last ``(B, H, W, C)`` tensors; inside a
stage the blocks work on the flat ``(B, H * W, C)`` view of the same memory.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

from .. import ops


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
        p, (h, w) = self.patch_size, x.shape[-2:]
        x = F.pad(x, (0, (w + p - 1) // p * p - w, 0, (h + p - 1) // p * p - h))  # (as a tracer sees it: no %)
        # A channels-last input makes the convolution write channels-last, so the permute
        # below is a view: no transposing copy of the largest feature map.
        x = self.proj(x.contiguous(memory_format=torch.channels_last))
        return self.norm(x.permute(0, 2, 3, 1))


class Mlp(nn.Sequential):
    """Two-layer feed-forward network: ``fc1 -> GELU -> drop1 -> fc2 -> drop2``, ``(..., C)`` ->
    ``(..., C)`` (a sequence of modules, as torchvision's ``MLP``; the dropouts named as timm's)."""

    def __init__(self, embed_dims: int, hidden_dims: int, drop_rate: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, hidden_dims)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop_rate)
        self.fc2 = nn.Linear(hidden_dims, embed_dims)
        self.drop2 = nn.Dropout(drop_rate)


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

    def forward(self, x: torch.Tensor, layout: ops.WindowLayout) -> torch.Tensor:
        """``proj(attention(qkv(windows(x))))``: ``(B, H * W, C)`` -> ``(B, H * W, C)``.

        The tokens are padded, shifted and cut into ``layout``'s windows (one gather), projected
        to q, k, v, attend within their window (a bias per relative offset, a mask between shift
        regions and padding), and return to row-major order before the output projection, which
        thus runs on real tokens only. ``layout``: the stage's, bound to the forward's plan
        (:func:`swin_backbone.ops.stage_layouts`).
        """
        qkv = self.qkv(ops.window_partition(x, layout))  # (B, nW * N, 3C), windows' order
        out = ops.window_attention(qkv, self.relative_position_bias_table, layout, num_heads=self.num_heads,
                                   scale=self.scale, dropout_p=self.attn_drop_rate if self.training else 0.0)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, window_size={self.window_size}"


class SwinBlock(nn.Module):
    """Pre-norm (shifted-)window attention + MLP, each with a residual and stochastic depth.

    The block itself holds no size-dependent state: the stage hands it a
    :class:`~swin_backbone.ops.WindowLayout` with the gather indices and mask.
    """

    def __init__(
        self, embed_dims: int, num_heads: int, window_size: int, shift: bool, mlp_ratio: float = 4.0,
        qkv_bias: bool = True, qk_scale: Optional[float] = None, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.shift = shift
        self.norm1 = nn.LayerNorm(embed_dims)
        self.attn = WindowAttention(embed_dims, num_heads, window_size, qkv_bias, qk_scale, attn_drop_rate, drop_rate)
        self.drop_path = ops.DropPath(drop_path_rate)
        self.norm2 = nn.LayerNorm(embed_dims)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop_rate)

    def forward(self, x: torch.Tensor, layout: ops.WindowLayout) -> torch.Tensor:
        """``x + drop_path(attn(norm1(x)))``, then ``+ drop_path(mlp(norm2(x)))``:
        ``(B, H * W, C)`` -> ``(B, H * W, C)``."""
        x = x + self.drop_path(self.attn(self.norm1(x), layout), layout)
        if layout.row_chunks is None:
            return x + self.drop_path(self.mlp(self.norm2(x)), layout)
        rows = x.view(-1, x.shape[-1])
        for part in layout.row_chunks:  # (CPU inference: cache-sized rows, added in place)
            rows[part].add_(self.mlp(self.norm2(rows[part])))
        return x


def merge_2x2(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each 2x2 cell of a ``(B, H, W, C)`` map: ``(B, ceil(H / 2), ceil(W / 2), 4C)``,
    odd sizes padded bottom / right with zeros first, channels in the official order
    ``x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]`` (block ``2 * dw + dh``). With
    per-image valid sizes a stage returns zeros beyond each image, so the cells across an
    image's edge read the zeros they read for the image alone."""
    b, h, w, c = x.shape
    h2, w2 = (h + 1) // 2, (w + 1) // 2
    x = F.pad(x, (0, 0, 0, 2 * w2 - w, 0, 2 * h2 - h))
    # (B, h2, dh, w2, dw, C) -> (B, h2, w2, dw, dh, C); the reshape copies (dh and dw swap).
    merged = x.view(b, h2, 2, w2, 2, c).permute(0, 1, 3, 4, 2, 5).reshape(b, h2, w2, 4 * c)
    return merged


class PatchMerging(nn.Module):
    """2x2 neighbourhood concatenation + LayerNorm + linear reduction ``4C -> 2C``.

    :func:`merge_2x2` concatenates in the official order (as timm and torchvision); mmdet's
    nn.Unfold order is converted when its weights are loaded. ``(B, H, W, C)`` ->
    ``(B, ceil(H / 2), ceil(W / 2), 2C)``.
    """

    def __init__(self, embed_dims: int, out_dims: Optional[int] = None, norm: bool = True) -> None:
        super().__init__()
        out_dims = out_dims or 2 * embed_dims
        self.norm = nn.LayerNorm(4 * embed_dims) if norm else nn.Identity()
        self.reduction = nn.Linear(4 * embed_dims, out_dims, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduction(self.norm(merge_2x2(x)))


class SwinStage(nn.Module):
    """``depth`` Swin blocks (every second one shifted) and an optional patch merging.

    Arguments as :class:`SwinBlock`'s and :class:`~swin_backbone.SwinBackbone`'s, plus
    ``drop_path_rates`` (one per block), ``downsample`` (append a ``merging``) and
    ``block_options`` (per block, extra keyword arguments for ``block``).
    """

    def __init__(
        self, embed_dims: int, depth: int, num_heads: int, window_size: int, drop_path_rates: Sequence[float],
        downsample: bool, mlp_ratio: float = 4.0, qkv_bias: bool = True, qk_scale: Optional[float] = None,
        drop_rate: float = 0.0, attn_drop_rate: float = 0.0, patch_norm: bool = True, pad_small_map: bool = True,
        mask_padding: bool = True, with_cp: bool = False, block: Callable[..., nn.Module] = SwinBlock,
        merging: Callable[..., nn.Module] = PatchMerging, block_options: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> None:
        super().__init__()
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.window_size = window_size
        self.shift_size = window_size // 2
        self.pad_small_map = pad_small_map
        self.mask_padding = mask_padding
        self.with_cp = with_cp
        self.mlp_hidden_dims = int(embed_dims * mlp_ratio)  #: sizes the row chunks of inference
        self.blocks = nn.ModuleList(
            block(embed_dims, num_heads, window_size, shift=i % 2 == 1, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                  qk_scale=qk_scale, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
                  drop_path_rate=drop_path_rates[i], **(block_options[i] if block_options else {}))
            for i in range(depth)
        )
        self.downsample = merging(embed_dims, norm=patch_norm) if downsample else None

    def forward(self, x: torch.Tensor, plan: ops.Plan, images: Union[ops.Sizes, torch.Tensor, None] = None
                ) -> torch.Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)`` through the blocks (no merging); ``plan``: the
        stage's (:func:`swin_backbone.ops.plan_stages`), or for a stage on its own
        :func:`swin_backbone.ops.plan_for`'s.

        ``images``, per image, its ``(h, w)`` tokens on this map: the blocks run on the images'
        real tokens alone, packed into ``(1, T, C)`` (each image in the windows it has alone);
        or a ``(B, H, W)`` bool map (static shapes): the whole map, with a mask per image. Either
        way each image's tokens are those of the image alone, and the map returned is zero
        beyond it."""
        regular, shifted = ops.stage_layouts(
            x, plan, window_size=self.window_size, shift_size=self.shift_size, pad_small_map=self.pad_small_map,
            mask_padding=self.mask_padding, images=images, row_width=self.mlp_hidden_dims)
        tokens = regular.pack(x)  # (B, H * W, C), or packed (1, T, C)
        with_cp = self.with_cp and self.training and plan.grad
        with ops.LEAN_SAVES[plan.save_memory]:  # (training on the CPU: no norm or GELU output kept for backward)
            for block in self.blocks:
                layout = shifted if block.shift and shifted is not None else regular
                if with_cp:
                    tokens = checkpoint.checkpoint(block, tokens, layout, use_reentrant=False)
                else:
                    tokens = block(tokens, layout)
        return regular.unpack(tokens, x.shape)


ops.EXACT_SWIN_MODULES.extend((PatchEmbed, ops.DropPath, Mlp, WindowAttention, SwinBlock, PatchMerging, SwinStage))
