"""How tokens are laid out: window layouts of a map size (gathers and attention mask, packing),
CPU row chunks (:func:`row_chunks`), the output maps' NCHW layout (:func:`output_nchw`), and the
one owner of the ops' caches (:func:`size_cache`, :func:`register_cache`, :func:`clear_caches`).

No host-device sync in a forward: host-side work runs on the CPU and moves with one
non-blocking copy (:func:`to_device`); a traceable layout is built with torch ops alone.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache, wraps
from typing import Callable, List, Optional, Tuple, TypeVar, Union

import torch

from torch import nn

from .plan import Plan, Sizes
from .windows import (
    ceil_div, mask_buffer, mask_from_labels, mask_rows, needs_mask, pad_amount, partition_grid, region_labels,
    relative_position_index, window_inverse_index, window_token_index,
)

T = TypeVar("T")

_CACHES: List = []  #: every cache of the ops, emptied by :func:`clear_caches`

CPU = torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU-built ``t`` on ``device`` without making the host wait: CUDA copies asynchronously
    only from pinned memory; other backends get a plain copy (not all keep a pageable source
    alive for an asynchronous one)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=device.type == "meta")


@dataclass(frozen=True)
class WindowLayout:
    """Where a stage's tokens go for window attention, for one map size, window and shift, and
    (bound by the planner for one forward: :attr:`plan`) how the attention is computed.

    Attributes:
        index: ``(nW * N,)`` gather from ``H * W`` tokens (padding slots read token 0, then zeroed;
            in a traceable layout ``H * W``, an appended zero token).
        inverse: ``(H * W,)`` gather back to row-major tokens.
        pad_slots: ``(nP,)`` padding positions in the window layout (``None``: none, or traceable).
        mask: ``(nW, N, N)`` additive mask of every window (per image ``(B, nW, N, N)``), or
            ``None`` (no window needs one); bias_index: ``(N * N,)`` bias table rows.
        rows: a *packed* layout's (:func:`~.image_sizes.packed_layout`) ``(T,)`` rows of the flat
            ``(B * H * W)`` map that its ``T`` tokens are; ``None``: the layout of the whole map.
        image_tokens: a packed layout's tokens per image, in order (``sum = T``); ``None`` otherwise.
        valid: an image-masked layout's (:func:`~.image_sizes.image_masked_layout`) ``(B, H * W)``
            bool, True inside each image; ``None`` otherwise.
        plan: the forward's :class:`~.plan.Plan` for this stage (``None``: not bound yet).
        row_chunks: in CPU inference with exact modules (:class:`~.plan.Plan`'s ``exact_modules``, no
            ``grad``, ``chunk_bytes``), the slices of the stage's ``(B * H * W)`` token rows that
            the blocks' MLPs run on one at a time; ``None``: whole tensors.
    """

    height: int
    width: int
    window: int
    shift: int
    num_windows: int
    table_window: int  #: window of the bias table that ``bias_index`` reads (``>= window``)
    has_padding: bool
    index: torch.Tensor
    inverse: torch.Tensor
    pad_slots: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    bias_index: torch.Tensor
    align: bool = False  #: mask rows are 8-aligned for fused CUDA kernels (biases added to it are too)
    rows: Optional[torch.Tensor] = None
    image_tokens: Optional[Tuple[int, ...]] = None
    valid: Optional[torch.Tensor] = None
    traceable: bool = False  #: the form a tracer records: padding read at an appended zero token
    plan: Optional[Plan] = None
    row_chunks: Optional[Tuple[slice, ...]] = None

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """A stage's ``(B, H, W, C)`` map -> its tokens: ``(B, H * W, C)``, or a packed layout's
        ``(1, T, C)`` (the images' real tokens only)."""
        b, h, w, c = x.shape
        if self.rows is None:
            return x.reshape(b, h * w, c)
        return x.reshape(b * h * w, c).index_select(0, self.rows).unsqueeze(0)

    def unpack(self, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of :meth:`pack` to a ``shape`` ``(B, H, W, C)`` map, zeros beyond each image
        (packed or image-masked): a next merging's cells there read what they read alone."""
        b, h, w, c = shape
        if self.valid is not None:
            tokens = torch.where(self.valid.unsqueeze(-1), tokens, tokens.new_zeros(()))
        if self.rows is None:
            return tokens.view(b, h, w, c)
        return tokens.new_zeros(b * h * w, c).index_copy(0, self.rows, tokens[0]).view(b, h, w, c)


def build_window_layout(
    height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device, dtype: torch.dtype,
    align: bool = False, traceable: bool = False, table_window: int = 0,
) -> WindowLayout:
    """An uncached :class:`WindowLayout` (``table_window`` 0: ``window``). A ``traceable`` one
    (and any of symbolic sizes, a tracer's) always allows for padding: one graph serves every size."""
    if window <= 0 or not 0 <= shift < window:
        raise ValueError(f"window must be > 0 and 0 <= shift < window, got window={window}, shift={shift}")
    device = torch.device(device)
    num_windows = ceil_div(height, window) * ceil_div(width, window)
    table_window = table_window or window
    sizes = dict(height=height, width=width, window=window, shift=shift, num_windows=num_windows,
                 table_window=table_window)
    bias_index = relative_position_index(window, table_window, CPU)
    if traceable or not isinstance(height, int) or not isinstance(width, int):
        mask = None
        if shift > 0 or mask_padding:
            mask = mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)
        return WindowLayout(has_padding=True, index=window_token_index(height, width, window, shift, device),
                            inverse=window_inverse_index(height, width, window, shift, device), pad_slots=None,
                            mask=mask, bias_index=bias_index.to(device), align=align, traceable=True, **sizes)
    has_padding = pad_amount(height, window) > 0 or pad_amount(width, window) > 0
    index = window_token_index(height, width, window, shift, CPU)
    inverse = window_inverse_index(height, width, window, shift, CPU)
    pad_slots = None
    if has_padding:
        is_pad = index == height * width
        pad_slots = is_pad.nonzero().squeeze(1)
        index = index.masked_fill(is_pad, 0)
    buffer = None
    if needs_mask(height, width, window, shift, mask_padding):
        labels = partition_grid(region_labels(height, width, window, shift, mask_padding, CPU), window)
        buffer = mask_buffer(labels, dtype, align)
    # The whole (8-aligned) buffer is copied, so that the mask's rows stay aligned on the device.
    mask = None if buffer is None else mask_rows(to_device(buffer, device), window * window)
    return WindowLayout(has_padding=has_padding, index=to_device(index, device), inverse=to_device(inverse, device),
                        pad_slots=None if pad_slots is None else to_device(pad_slots, device), mask=mask,
                        bias_index=to_device(bias_index, device), align=align, **sizes)


def register_cache(cache: T) -> T:
    """Make ``cache`` (anything with ``cache_clear()``) one that :func:`clear_caches` empties."""
    _CACHES.append(cache)
    return cache


def size_cache(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``lru_cache`` for size-only helpers, registered with :func:`clear_caches`; for eager
    callers only (while tracing, sizes may be symbolic: callers then call the helper itself)."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        @lru_cache(maxsize=maxsize)
        @wraps(fn)
        def cached(*args):
            # Cached tensors outlive the call: built under inference_mode they would be
            # inference tensors, unusable by a later training step at the same size.
            with torch.inference_mode(False):
                return fn(*args)

        return register_cache(cached)

    return decorate


#: Cached :func:`build_window_layout`. An entry holds its mask (15-24 MB at stage 1 of 800 x 1344):
#: more entries could hold GBs under multi-scale training (hundreds of shapes, 8 layouts each).
get_window_layout = size_cache(maxsize=256)(build_window_layout)


def clear_caches() -> None:
    """Empty every cache of the ops (e.g. to free device memory after a size sweep)."""
    for cache in _CACHES:
        cache.cache_clear()


# ------------------------------------------------------------------------------ images in a batch
def sizes_tensor(valid_sizes: Sizes, device: torch.device) -> torch.Tensor:
    """``(B, 2)`` int64 ``(h, w)`` per image on ``device`` (moved without a host wait)."""
    return to_device(torch.tensor(valid_sizes, dtype=torch.long).view(-1, 2), device)


def valid_map(sizes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(B, H, W)`` bool, True inside each image's ``(h, w)`` of ``sizes`` ``(B, 2)`` (traceable)."""
    rows = torch.arange(height, device=sizes.device)[None, :, None] < sizes[:, 0, None, None]
    cols = torch.arange(width, device=sizes.device)[None, None, :] < sizes[:, 1, None, None]
    return rows & cols


def valid_token_mask(height: int, width: int, valid_sizes: Sizes, device: torch.device) -> torch.Tensor:
    """``(B, H, W)`` bool: True inside the image's valid size (sizes moved without a host wait)."""
    return valid_map(sizes_tensor(valid_sizes, device), height, width)


#: Cached :func:`valid_token_mask`: a padded batch's sizes recur every step of its forward.
get_valid_token_mask = size_cache(maxsize=64)(valid_token_mask)


def zero_beyond_valid(x: torch.Tensor, valid_sizes: Sizes, height_dim: int, inplace: bool) -> torch.Tensor:
    """Zero ``x`` beyond each image's valid ``(h, w)``; H, W are dims ``height_dim``, ``+ 1``
    (``(B, C, H, W)``: 2); ``inplace`` or a new tensor."""
    height, width = x.shape[height_dim], x.shape[height_dim + 1]
    if not inplace:
        keep = get_valid_token_mask(height, width, valid_sizes, x.device)
        keep = keep.view(keep.shape[:1] + (1,) * (height_dim - 1) + keep.shape[1:] + (1,) * (x.dim() - height_dim - 2))
        return torch.where(keep, x, x.new_zeros(()))  # (keeps x's memory format: masked_fill makes it contiguous)
    for b, (h, w) in enumerate(valid_sizes):
        if h < height:
            x[b].narrow(height_dim - 1, h, height - h).zero_()
        if w < width:
            x[b].narrow(height_dim - 1, 0, h).narrow(height_dim, w, width - w).zero_()
    return x



# ------------------------------------------------------------------------------ rows
def cpu_chunk_bytes() -> int:
    """Bytes of a CPU row chunk: twice the L2 cache of the cores torch uses, within 4-16 MiB
    (not the L3: virtual machines report the whole host's)."""
    try:
        l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError):
        l2 = 0
    l2 = l2 if l2 > 0 else 2**20
    return int(min(16 * 2**20, max(4 * 2**20, 2 * l2 * torch.get_num_threads())))


def row_chunks(total: int, row_bytes: int, budget: int) -> Tuple[slice, ...]:
    """``range(total)`` in ``ceil(total * row_bytes / budget)`` slices (``budget`` 0: one; at least
    a row each, and one slice also for ``total`` 0), as even as possible (a short tail's matmuls
    run at a lower rate): each within ``budget`` bytes of ``row_bytes`` rows, or one row over it."""
    count = 1 if budget <= 0 else min(max(total, 1), max(1, -(-total * row_bytes // budget)))
    return tuple(slice(i * total // count, (i + 1) * total // count) for i in range(count))


row_chunks = register_cache(lru_cache(maxsize=256)(row_chunks))  # (a forward asks again for each size)


def output_nchw(x: torch.Tensor, norm: nn.Module, channels_last: bool, plan: Plan,
                sizes: Union[Sizes, torch.Tensor, None] = None) -> torch.Tensor:
    """``norm(x)`` of a ``(B, H, W, C)`` map as ``(B, C, H, W)`` (a channels-last view or
    contiguous), zeros beyond each image's ``sizes``: ``(h, w)`` per image, or a ``(B, H, W)``
    bool map of the images' tokens (static shapes); ``None``: every image fills the map."""
    if channels_last:
        out, own = norm(x).permute(0, 3, 1, 2), None  # a view of the module's output
    elif plan.exact_modules and not plan.grad and plan.chunk_bytes > 0:  # (inference: by map rows: whole, the transposing copy's strided writes miss the cache)
        batch, height, width, channels = x.shape
        out = None
        for rows in row_chunks(height, width * channels * x.element_size(), plan.chunk_bytes // 8):
            part = norm(x[:, rows]).permute(0, 3, 1, 2)
            if out is None:  # dtype known only now (autocast)
                out = part.new_empty(batch, channels, height, width)
            out[:, :, rows] = part
        own = out
    else:
        view = norm(x).permute(0, 3, 1, 2)
        out = view.contiguous()
        own = None if out is view else out  # (a 1 x 1 map is contiguous already: no copy made)
    if sizes is None:
        return out
    if isinstance(sizes, torch.Tensor):
        return torch.where(sizes.unsqueeze(1), out, out.new_zeros(()))
    # Zeroed in place only in memory of our own, or where module outputs may be written.
    inplace = not plan.grad and (own is not None or plan.exact_modules)
    return zero_beyond_valid(out, sizes, 2, inplace=inplace)
