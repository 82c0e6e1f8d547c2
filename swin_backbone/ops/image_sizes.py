"""Per-image valid sizes in a padded batch: each image's windows as it has them alone, packed
(padding-only windows are not computed), and the zeroing that makes each image read what it
reads alone (docs/image-exact-batches.md).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Optional, Tuple

import torch

from .layouts import CPU, WindowLayout, get_window_layout, register_cache, size_cache, to_device, valid_map, zero_beyond_valid
from .plan import Sizes
from .windows import MASK_VALUE, ceil_div, mask_rows, output_size, row_length

def packed_layout(
    height: int, width: int, window: int, shift: int, valid_sizes: Sizes, device: torch.device, dtype: torch.dtype,
    align: bool = False, table_window: int = 0, traceable: bool = False,
) -> WindowLayout:
    """The windows of a batch's images, each as it is alone, packed into one row of tokens.

    Image ``b`` is the top-left ``valid_sizes[b] = (h_b, w_b)`` of a ``height x width`` map. It
    gets the layout it has alone (its own map padded to whole windows, shifted by ``shift``
    within it, padding a region of its own), its ``h_b * w_b`` real tokens following image
    ``b - 1``'s: ``T = sum h_b * w_b`` tokens in ``K = sum nW_b`` windows, whose masks are the
    images' own (zeros for an image that needs none). Windows holding batch padding only are not
    in it.
    :attr:`~.layouts.WindowLayout.rows`: the ``(T,)`` rows of the flat ``(B * height * width)``
    map the tokens are, and :attr:`~.layouts.WindowLayout.image_tokens` each image's
    ``h_b * w_b``; the layout itself is one row (height 1, width ``T``). Built on the CPU from the
    images' cached layouts, one copy per tensor to ``device``.

    ``traceable`` (for compiled blocks): padding slots read an appended zero token (index ``T``), as
    a traceable layout's do, rather than being listed in ``pad_slots``: a compiled block then has no
    tensor sized by the padding-slot count, whose size dynamic shapes could equate with another
    (a recompile when they later differ).
    """
    n = window * window
    parts = [get_window_layout(h, w, window, shift, True, CPU, dtype, align, False, table_window)
             for h, w in valid_sizes]
    index, inverse, pad_slots, rows, masks = [], [], [], [], []
    tokens = slots = 0
    for b, ((h, w), part) in enumerate(zip(valid_sizes, parts)):
        index.append(part.index + tokens)  # (padding slots read the image's token 0, then are zeroed)
        inverse.append(part.inverse + slots)
        if part.pad_slots is not None:
            pad_slots.append(part.pad_slots + slots)
        rows.append((b * height * width + torch.arange(h)[:, None] * width + torch.arange(w)).reshape(-1))
        masks.append((slots // n, part))
        tokens, slots = tokens + h * w, slots + part.num_windows * n
    num_windows = slots // n
    index, inverse = torch.cat(index), torch.cat(inverse)
    pad_slots = torch.cat(pad_slots) if pad_slots else None
    buffer = None
    if any(part.mask is not None for _, part in masks):
        buffer = torch.zeros(num_windows, n, row_length(n, align), dtype=dtype)  # rows aligned as the shared ones
        for first, part in masks:
            if part.mask is not None:
                buffer.narrow(0, first, part.mask.shape[0]).narrow(-1, 0, n).copy_(part.mask)
    mask = None if buffer is None else mask_rows(to_device(buffer, device), n)
    if traceable and pad_slots is not None:
        index[pad_slots] = tokens
    return WindowLayout(
        height=1, width=tokens, window=window, shift=shift, num_windows=num_windows,
        table_window=parts[0].table_window, has_padding=pad_slots is not None or traceable,
        index=to_device(index, device), inverse=to_device(inverse, device),
        pad_slots=to_device(pad_slots, device) if pad_slots is not None and not traceable else None, mask=mask,
        bias_index=to_device(parts[0].bias_index, device), align=align, rows=to_device(torch.cat(rows), device),
        image_tokens=tuple(h * w for h, w in valid_sizes), traceable=traceable,
    )


#: Cached :func:`packed_layout`, keyed by the map's and the images' sizes.
get_packed_layout = size_cache(maxsize=128)(packed_layout)


def stage_valid_sizes(valid_sizes: Sizes, patch_size: int, num_stages: int, height: int = 0, width: int = 0
                      ) -> Tuple[Optional[Sizes], ...]:
    """Per stage, the images' ``(h, w)`` tokens on its map (:func:`output_size` of each image's
    ``valid_sizes``, input pixels); with the input's ``height`` and ``width``, ``None`` for a
    stage whose map every image fills."""
    per_image = [output_size(h, w, patch_size, num_stages) for h, w in valid_sizes]
    per_stage = [tuple(sizes[i] for sizes in per_image) for i in range(num_stages)]
    if height and width:
        maps = output_size(height, width, patch_size, num_stages)
        per_stage = [None if all(v == maps[i] for v in sizes) else sizes for i, sizes in enumerate(per_stage)]
    return tuple(per_stage)


stage_valid_sizes = register_cache(lru_cache(maxsize=256)(stage_valid_sizes))  # (a padded batch's sizes recur)


def straddles(valid_sizes: Sizes, height: int, width: int, cell: int) -> Tuple[Tuple[int, int, int, int, int], ...]:
    """``(b, row0, row1, col0, col1)`` boxes that ``cell x cell`` cells straddling an image's edge
    read beyond it (alone, zero padding): zeroing them makes the batch read what the image reads."""
    boxes = []
    for b, (h, w) in enumerate(valid_sizes):
        h_end, w_end = min(ceil_div(h, cell) * cell, height), min(ceil_div(w, cell) * cell, width)
        if h < h_end:
            boxes.append((b, h, h_end, 0, w_end))
        if w < w_end:
            boxes.append((b, 0, h, w, w_end))
    return tuple(boxes)


straddles = register_cache(lru_cache(maxsize=256)(straddles))  # (a padded batch's sizes recur)


def zero_straddles_(x: torch.Tensor, valid_sizes: Sizes, height_dim: int, cell: int) -> torch.Tensor:
    """Zero the :func:`straddles` boxes of ``x`` in place (H, W: dims ``height_dim``, ``+ 1``)."""
    height, width = x.shape[height_dim], x.shape[height_dim + 1]
    for b, r0, r1, c0, c1 in straddles(valid_sizes, height, width, cell):
        x[b].narrow(height_dim - 1, r0, r1 - r0).narrow(height_dim, c0, c1 - c0).zero_()
    return x


def mask_input(x: torch.Tensor, valid_sizes: Optional[Sizes], patch_size: int) -> torch.Tensor:
    """``(B, C, H, W)`` input with zeros beyond an image where a patch straddles its edge (all
    beyond it if ``x`` requires grad); a copy where anything must be zeroed, else ``x`` itself."""
    if valid_sizes is None:
        return x
    if x.requires_grad:
        return zero_beyond_valid(x, valid_sizes, 2, inplace=False)
    boxes = straddles(valid_sizes, x.shape[2], x.shape[3], patch_size)
    # Batches padded with zeros (mmdet's and mmseg's preprocessors) need no copy; the check
    # reads only the boxes (on CUDA it would wait for the device: copy there instead).
    if not boxes or (x.device.type == "cpu" and not any(x[b, :, r0:r1, c0:c1].any() for b, r0, r1, c0, c1 in boxes)):
        return x
    return zero_straddles_(x.clone(), valid_sizes, 2, patch_size)


# ------------------------------------------------------------------------------ static shapes
# The same image-exact result with every shape fixed by the batch alone (a static-shape graph,
# a CUDA graph): the sizes are a tensor, the whole map is computed, and each image's tokens beyond
# its size are a region of their own in every window (masks instead of packing; sizes_tensor and
# valid_map above).
def stage_sizes(sizes: torch.Tensor, patch_size: int, num_stages: int) -> Tuple[torch.Tensor, ...]:
    """Per stage, ``(B, 2)`` token sizes of the images whose input-pixel sizes are ``sizes``
    (:func:`~.windows.output_size` of the tensors of heights and widths)."""
    per_stage = output_size(sizes[:, 0], sizes[:, 1], patch_size, num_stages)
    return tuple(torch.stack(hw, 1) for hw in per_stage)


def image_masked_layout(layout: WindowLayout, valid: torch.Tensor) -> WindowLayout:
    """``layout`` (a traceable one, of the whole map) with one mask per image: ``(B, nW, N, N)``,
    the map's own mask plus a mask between each image's tokens and those beyond it, so each image
    attends within its windows as it does alone (its padding is a region of its own there too).
    ``valid``: ``(B, H * W)`` bool, True inside the image."""
    if not layout.traceable:
        raise ValueError("image_masked_layout: expected a traceable layout (padding read at index H * W)")
    n = layout.window * layout.window
    dtype = torch.float32 if layout.mask is None else layout.mask.dtype
    # (window padding reads the appended False: beyond every image)
    flags = torch.nn.functional.pad(valid, (0, 1)).index_select(1, layout.index).view(valid.shape[0], -1, n)
    mask = (flags[..., :, None] != flags[..., None, :]).to(dtype) * MASK_VALUE
    if layout.mask is not None:
        mask = mask + layout.mask
    return dataclasses.replace(layout, mask=mask, valid=valid)
