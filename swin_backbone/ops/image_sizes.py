"""Per-image valid sizes in a padded batch: the windows that images' edges cut, their masks,
and the zeroing that makes each image read what it reads alone (docs/image-exact-batches.md).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .layouts import CPU, ImageWindows, size_cache, to_device
from .plan import Sizes
from .windows import (
    PAD_REGION, ceil_div, mask_buffer, mask_rows, output_size, padded_size, partition_grid, region_labels, row_length,
    window_token_index,
)

#: :data:`~.plan.Sizes`, or ``None``: every image fills the map.
ValidSizes = Optional[Sizes]


def image_window_masks(
    height: int, width: int, window: int, shift: int, valid: Tuple[int, int], device: torch.device,
    dtype: torch.dtype, align: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(k,)`` indices and ``(k, N, N)`` masks of the windows an image of ``valid = (h, w)``
    cuts; computed on the CPU (no device sync), one copy each to ``device``."""
    own = partition_grid(region_labels(height, width, window, shift, True, CPU, valid), window)
    shared = partition_grid(region_labels(height, width, window, shift, True, CPU), window)
    cut = (own != shared).any(1) & (own != PAD_REGION).any(1)
    windows = cut.nonzero().squeeze(1)
    buffer = mask_buffer(own.index_select(0, windows), dtype, align)
    return to_device(windows, device), mask_rows(to_device(buffer, device), window * window)


def image_windows(
    height: int, width: int, window: int, shift: int, valid_sizes: Sizes, device: torch.device, dtype: torch.dtype,
    align: bool = False,
) -> Optional[ImageWindows]:
    """:class:`ImageWindows` of a batch whose image ``b`` is the top-left ``valid_sizes[b]``;
    ``None`` where no window is cut. Computed on the CPU, one copy per tensor to ``device``."""
    num_windows = (padded_size(height, window) // window) * (padded_size(width, window) // window)
    windows, masks = [], []
    for b, valid in enumerate(valid_sizes):
        if tuple(valid) == (height, width):
            continue
        # The CPU entries: the windows' indices are read on the host below.
        index, mask = get_image_window_masks(height, width, window, shift, tuple(valid), CPU, dtype, align)
        if index.numel():
            windows.append(index + b * num_windows)
            masks.append(mask)
    if not windows:
        return None
    n = window * window
    masks = torch.cat(masks)  # dense rows: into a buffer of their own, aligned as the shared ones
    buffer = torch.zeros(masks.shape[:-1] + (row_length(n, align),), dtype=dtype)
    buffer.narrow(-1, 0, n).copy_(masks)
    windows = torch.cat(windows)
    # Row-major rows of the windows' positions (window_token_index marks padding H * W).
    tokens = height * width
    slots = ((windows % num_windows)[:, None] * n + torch.arange(n)).reshape(-1)
    source = window_token_index(height, width, window, shift, CPU).index_select(0, slots)
    real = source < tokens
    first = (windows // num_windows).repeat_interleave(n) * tokens
    rows = first + torch.where(real, source, torch.zeros_like(source))
    real = real.nonzero().squeeze(1)
    return ImageWindows(
        windows=to_device(windows, device),
        masks=mask_rows(to_device(buffer, device), n),
        real=to_device(real, device),
        real_rows=to_device(rows.index_select(0, real), device),
    )


get_image_window_masks = size_cache(maxsize=512)(image_window_masks)


get_image_windows = size_cache(maxsize=128)(image_windows)


def stage_valid_sizes(valid_sizes: Sizes, patch_size: int, num_stages: int) -> Tuple[Sizes, ...]:
    """``(num_stages, B)`` valid sizes on each stage's map (:func:`output_size` per image)."""
    per_image = [output_size(h, w, patch_size, num_stages) for h, w in valid_sizes]
    return tuple(tuple(sizes[i] for sizes in per_image) for i in range(num_stages))


def valid_token_mask(height: int, width: int, valid_sizes: Sizes, device: torch.device) -> torch.Tensor:
    """``(B, H, W)`` bool: True inside the image's valid size (sizes moved without a host wait)."""
    sizes = to_device(torch.tensor(valid_sizes, dtype=torch.long).view(-1, 2), device)
    rows = torch.arange(height, device=device)[None, :, None] < sizes[:, 0, None, None]
    cols = torch.arange(width, device=device)[None, None, :] < sizes[:, 1, None, None]
    return rows & cols


def zero_beyond_valid(x: torch.Tensor, valid_sizes: Sizes, height_dim: int, inplace: bool) -> torch.Tensor:
    """Zero ``x`` beyond each image's valid ``(h, w)``; H, W are dims ``height_dim``, ``+ 1``
    (``(B, C, H, W)``: 2); ``inplace`` or a new tensor."""
    height, width = x.shape[height_dim], x.shape[height_dim + 1]
    if not inplace:
        keep = valid_token_mask(height, width, valid_sizes, x.device)
        keep = keep.view(keep.shape[:1] + (1,) * (height_dim - 1) + keep.shape[1:] + (1,) * (x.dim() - height_dim - 2))
        return torch.where(keep, x, x.new_zeros(()))  # (keeps x's memory format: masked_fill makes it contiguous)
    for b, (h, w) in enumerate(valid_sizes):
        if h < height:
            x[b].narrow(height_dim - 1, h, height - h).zero_()
        if w < width:
            x[b].narrow(height_dim - 1, 0, h).narrow(height_dim, w, width - w).zero_()
    return x


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


def zero_straddles_(x: torch.Tensor, valid_sizes: Sizes, height_dim: int, cell: int) -> torch.Tensor:
    """Zero the :func:`straddles` boxes of ``x`` in place (H, W: dims ``height_dim``, ``+ 1``)."""
    height, width = x.shape[height_dim], x.shape[height_dim + 1]
    for b, r0, r1, c0, c1 in straddles(valid_sizes, height, width, cell):
        x[b].narrow(height_dim - 1, r0, r1 - r0).narrow(height_dim, c0, c1 - c0).zero_()
    return x


def zero_merged_straddles_(merged: torch.Tensor, valid_sizes: Sizes, height: int, width: int) -> torch.Tensor:
    """Zero, in place, what the 2x2 cells of a merged ``(B, ceil(H / 2), ceil(W / 2), 4C)`` map
    (block ``2 * dw + dh``) read across an image's odd edge on the ``height x width`` map
    (:func:`straddles`): for the image alone they read padding zeros there."""
    b, h2, w2, c4 = merged.shape
    cells = merged.view(b, h2, w2, 2, 2, c4 // 4)
    for i, r0, r1, c0, c1 in straddles(valid_sizes, height, width, 2):
        if c0 == 0:  # row r0 below an odd height: dh = 1 of the cells in its row
            cells[i, r0 // 2, : (c1 + 1) // 2, :, 1].zero_()
        else:  # column c0 right of an odd width: dw = 1 of the cells in its column
            cells[i, : (r1 + 1) // 2, c0 // 2, 1].zero_()
    return merged


def mask_input(x: torch.Tensor, valid_sizes: ValidSizes, patch_size: int) -> torch.Tensor:
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
