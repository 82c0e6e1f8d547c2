"""Resizing pretrained tensors to a model of another window, grid or input channel count.

Pure torch (no scipy), so it runs wherever the model runs.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

Size2 = Union[int, Tuple[int, int]]


def _pair(size: Size2) -> Tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def table_window(rows: int) -> Tuple[int, int]:
    """Window of a square relative-position-bias table with ``rows = (2w - 1) ** 2`` rows."""
    side = math.isqrt(rows)
    if side * side != rows or side % 2 == 0:
        raise ValueError(f"relative_position_bias_table: expected (2w-1)**2 rows for a square window, got {rows}")
    return (side + 1) // 2, (side + 1) // 2


def resize_relative_position_bias_table(
    table: torch.Tensor, new_window: Size2, old_window: Optional[Size2] = None
) -> torch.Tensor:
    """Bicubic resize of a ``((2h-1) * (2w-1), nH)`` bias table to another window.

    Args:
        table: ``((2h-1) * (2w-1), nH)``.
        new_window: target window ``w`` or ``(h, w)`` (non-square allowed).
        old_window: source window; inferred for square tables when ``None``.
    Returns:
        ``((2h'-1) * (2w'-1), nH)`` in the table's dtype.
    """
    old_h, old_w = _pair(old_window) if old_window is not None else table_window(table.shape[0])
    new_h, new_w = _pair(new_window)
    heads = table.shape[1]
    if (old_h, old_w) == (new_h, new_w):
        return table
    grid = table.float().T.reshape(1, heads, 2 * old_h - 1, 2 * old_w - 1)
    grid = F.interpolate(grid, size=(2 * new_h - 1, 2 * new_w - 1), mode="bicubic", align_corners=False)
    return grid.reshape(heads, -1).T.contiguous().to(table.dtype)


def pos_embed_grid(pos: torch.Tensor, grid_hint: Tuple[int, int]) -> torch.Tensor:
    """Absolute position embedding in any stored layout -> ``(1, C, Gh, Gw)``.

    ``(1, C, Gh, Gw)`` (ours, official detection) is returned as is; ``(1, L, C)``
    (classification, mmdet) is reshaped to ``grid_hint`` when ``Gh * Gw == L``, else to a
    square grid.
    """
    if pos.dim() == 4:
        return pos
    if pos.dim() != 3:
        raise ValueError(f"absolute_pos_embed: expected (1, L, C) or (1, C, H, W), got shape {tuple(pos.shape)}")
    length = pos.shape[1]
    gh, gw = grid_hint
    if gh * gw != length:
        side = math.isqrt(length)
        if side * side != length:
            raise ValueError(f"absolute_pos_embed: cannot infer the grid of {length} positions")
        gh = gw = side
    return pos.transpose(1, 2).reshape(1, pos.shape[2], gh, gw)


def resize_pos_embed(pos: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
    """Bicubic resize of a ``(1, C, Gh, Gw)`` position embedding to ``grid``."""
    if tuple(pos.shape[-2:]) == tuple(grid):
        return pos
    return F.interpolate(pos.float(), size=grid, mode="bicubic", align_corners=False).to(pos.dtype)


def adapt_patch_embed_channels(weight: torch.Tensor, in_channels: int) -> torch.Tensor:
    """Patch-embedding conv weight ``(C, c_in, p, p)`` -> ``(C, in_channels, p, p)``.

    * ``in_channels == 1``: the RGB filters are summed (a grey image = R = G = B).
    * otherwise the filters are repeated cyclically over the new channels and scaled by
      ``c_in / in_channels`` so that the response to a constant image is unchanged.
    """
    c_in = weight.shape[1]
    if c_in == in_channels:
        return weight
    if in_channels == 1:
        return weight.sum(dim=1, keepdim=True)
    reps = math.ceil(in_channels / c_in)
    return weight.repeat(1, reps, 1, 1)[:, :in_channels] * (c_in / in_channels)
