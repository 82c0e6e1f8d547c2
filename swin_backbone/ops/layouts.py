"""Window layouts of a map size (gathers and attention mask), and the one owner of the ops'
caches (:func:`size_cache`, :func:`register_cache`, :func:`clear_caches`).

No host-device sync in a forward: host-side work runs on the CPU and moves with one
non-blocking copy (:func:`to_device`); while tracing, layouts are built with plain ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, wraps
from typing import Callable, List, Optional, Tuple, TypeVar

import torch

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
    """Everything window attention needs for one map size, window and shift.

    Attributes:
        index: ``(nW * N,)`` gather from ``H * W`` tokens (padding slots read token 0, then zeroed;
            while tracing ``H * W`` is an appended zero token).
        inverse: ``(H * W,)`` gather back to row-major tokens.
        pad_slots: ``(nP,)`` padding positions in the window layout (``None``: none, or tracing).
        mask: ``(nW, N, N)`` additive mask of every window, or ``None`` (no window needs one);
            bias_index: ``(N * N,)`` bias table rows.
        rows: a *packed* layout's (:func:`~.image_sizes.packed_layout`) ``(T,)`` rows of the flat
            ``(B * H * W)`` map that its ``T`` tokens are; ``None``: the layout of the whole map.
        image_tokens: a packed layout's tokens per image, in order (``sum = T``); ``None`` otherwise.
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
    rows: Optional[torch.Tensor] = None
    image_tokens: Optional[Tuple[int, ...]] = None
    traced: bool = False


def build_window_layout(
    height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device, dtype: torch.dtype,
    align: bool = False, tracing: bool = False, table_window: int = 0,
) -> WindowLayout:
    """An uncached :class:`WindowLayout` (``table_window`` 0: ``window``). While tracing, sizes may
    be symbolic, so the layout always allows for padding: one graph serves every size."""
    if window <= 0 or not 0 <= shift < window:
        raise ValueError(f"window must be > 0 and 0 <= shift < window, got window={window}, shift={shift}")
    device = torch.device(device)
    num_windows = ceil_div(height, window) * ceil_div(width, window)
    table_window = table_window or window
    sizes = dict(height=height, width=width, window=window, shift=shift, num_windows=num_windows,
                 table_window=table_window)
    bias_index = relative_position_index(window, table_window, CPU)
    if tracing or not isinstance(height, int) or not isinstance(width, int):
        mask = None
        if shift > 0 or mask_padding:
            mask = mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)
        return WindowLayout(has_padding=True, index=window_token_index(height, width, window, shift, device),
                            inverse=window_inverse_index(height, width, window, shift, device), pad_slots=None,
                            mask=mask, bias_index=bias_index.to(device), traced=True, **sizes)
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
                        bias_index=to_device(bias_index, device), **sizes)


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
