"""Window layouts of a map size (the gather indices and the attention mask), and the one owner
of the ops' caches.

A :class:`WindowLayout` holds, for one map size, window and shift, the gathers between
row-major tokens and the window layout and the attention mask (:mod:`.windows` computes
them). Layouts depend only on sizes, so they are cached (:func:`get_window_layout`); every
cache of the ops is made by :func:`size_cache` or registered with :func:`register_cache`,
and :func:`clear_caches` empties them all.

No host-device synchronisation in a forward: eagerly, whatever needs values on the host
(``nonzero``, tensors from Python lists) is computed on the CPU, and each result moves to the
target device with one non-blocking copy (:func:`to_device`). A layout built while tracing
(``tracing=True``: ``torch.compile``, ``torch.export``, ``torch.jit.trace``; sizes possibly
symbolic) is built with plain ops on the device, and its gathers use only ops the tracer knows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, wraps
from typing import Callable, List, Optional, TypeVar

import torch

from ..torch_compat import is_compiling
from .windows import (
    ceil_div, mask_buffer, mask_from_labels, mask_rows, needs_mask, pad_amount, partition_grid, region_labels,
    relative_position_index, window_inverse_index, window_token_index,
)

T = TypeVar("T")

#: Every cache of the ops (:func:`size_cache`, :func:`register_cache`): :func:`clear_caches`.
_CACHES: List = []

CPU = torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``, built on the CPU, on ``device``: itself for the CPU, else one copy that does not
    make the host wait for the device.

    CUDA copies asynchronously only from pinned memory (from pageable memory the host waits
    for the stream); the caching host allocator keeps the pinned block until the copy is done.
    Meta tensors hold no data, so nothing can wait (tests check the copies there). Other
    devices get a plain copy: not every backend keeps a pageable source alive until an
    asynchronous copy has read it.
    """
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=device.type == "meta")


@dataclass(frozen=True)
class ImageWindows:
    """Windows of a batch whose mask differs per image: those an image's boundary cuts.

    An image that is only the top-left ``h x w`` of a batch map treats every token beyond it as
    padding (:func:`~.windows.region_labels` with ``valid``). That changes the mask only of windows
    holding tokens of the image and tokens beyond it (windows wholly beyond it keep the shared mask:
    nothing of the image reads their results).

    Attributes:
        windows: ``(K,)`` int64 indices into the batch's ``B * nW`` windows (``b * nW + w``).
        masks: ``(K, N, N)`` additive masks of those windows, in the compute dtype
            (8-aligned rows with ``align``, as :func:`~.windows.window_attention_mask`).
        rows: ``(K * N,)`` the row of the batch's flat ``(B * H * W)`` row-major tokens that
            each position of those windows holds (the image's token 0 for window padding),
            for kernels that read row-major tokens (the fused Triton one).
        real: ``(R,)`` the positions among the ``K * N`` that hold real tokens.
        real_rows: ``(R,)`` their rows, ``rows[real]`` (where results are written back).
    """

    windows: torch.Tensor
    masks: torch.Tensor
    rows: torch.Tensor
    real: torch.Tensor
    real_rows: torch.Tensor


@dataclass(frozen=True)
class WindowLayout:
    """Everything window attention needs for one map size, window and shift.

    Attributes:
        height, width, window, shift: real map size ``H, W``; effective window and shift.
        num_windows: ``nW``, windows of the padded map.
        has_padding: whether the window layout holds padding tokens (zeros).
        padding_masked: padding tokens are masked out of attention (``mask_padding``), so
            the values they carry cannot change any real token's result.
        index: ``(nW * N,)`` gather from ``H * W`` row-major tokens to the window layout
            (padding slots read token 0 and are zeroed after the gather); while tracing, into
            ``H * W + 1`` tokens, ``H * W`` a zero token appended.
        inverse: ``(H * W,)`` gather from the window layout back to row-major tokens.
        pad_slots: ``(nP,)`` positions of the padding tokens in the window layout (``None``:
            none, or tracing).
        mask: ``(nW, N, N)`` additive mask in the compute dtype, or ``None`` (no window mixes regions).
        bias_index: ``(N * N,)`` rows of a ``((2 tw - 1) ** 2, nH)`` relative position bias table
            (``tw``: the table's window, >= ``window``) for each query-key pair of a window.
        images: the windows that the boundaries of a batch's images cut (per-image valid
            sizes, :func:`~.image_sizes.get_image_windows`), or ``None``: every image fills the map.
        traced: built while tracing (gathers in plain ops).
    """

    height: int
    width: int
    window: int
    shift: int
    num_windows: int
    has_padding: bool
    padding_masked: bool
    index: torch.Tensor
    inverse: torch.Tensor
    pad_slots: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    bias_index: torch.Tensor
    images: Optional[ImageWindows] = None
    traced: bool = False


def build_window_layout(
    height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device, dtype: torch.dtype,
    align: bool = False, tracing: bool = False, table_window: int = 0,
) -> WindowLayout:
    """A :class:`WindowLayout` (uncached; see :func:`get_window_layout`); ``table_window``: the
    window of the bias table the layout's ``bias_index`` reads (0: ``window``).

    Eagerly, its tensors are computed on the CPU and copied to ``device`` once each. While
    tracing (``tracing``), sizes may be symbolic and whether a size needs padding is not
    known, so the layout always allows for it (a zero token that may go unused, a mask that
    may be all zeros): one graph serves every size; its tensors are built with plain ops on
    ``device`` (the tracer records them).
    """
    if window <= 0 or not 0 <= shift < window:
        raise ValueError(f"window must be > 0 and 0 <= shift < window, got window={window}, shift={shift}")
    device = torch.device(device)
    num_windows = ceil_div(height, window) * ceil_div(width, window)
    sizes = dict(height=height, width=width, window=window, shift=shift, num_windows=num_windows,
                 padding_masked=mask_padding)
    bias_index = relative_position_index(window, table_window or window, CPU)
    if tracing or not isinstance(height, int) or not isinstance(width, int):
        mask = None
        if shift > 0 or mask_padding:
            mask = mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)
        return WindowLayout(has_padding=True, index=window_token_index(height, width, window, shift, device),
                            inverse=window_inverse_index(height, width, window, shift, device), pad_slots=None,
                            mask=mask, bias_index=bias_index.to(device), traced=True, **sizes)
    has_padding = pad_amount(height, window) > 0 or pad_amount(width, window) > 0
    index = window_token_index(height, width, window, shift, CPU)
    pad_slots = None
    if has_padding:
        is_pad = index == height * width
        pad_slots = to_device(is_pad.nonzero().squeeze(1), device)
        index = index.masked_fill(is_pad, 0)
    mask = None
    if needs_mask(height, width, window, shift, mask_padding):
        labels = partition_grid(region_labels(height, width, window, shift, mask_padding, CPU), window)
        # The whole (8-aligned) buffer is copied, so that the mask's rows stay aligned on the device.
        mask = mask_rows(to_device(mask_buffer(labels, dtype, align), device), window * window)
    return WindowLayout(has_padding=has_padding, index=to_device(index, device),
                        inverse=to_device(window_inverse_index(height, width, window, shift, CPU), device),
                        pad_slots=pad_slots, mask=mask, bias_index=to_device(bias_index, device), **sizes)


def register_cache(cache: T) -> T:
    """Make ``cache`` (anything with ``cache_clear()``, e.g. an ``lru_cache``) one that
    :func:`clear_caches` empties. Returns it."""
    _CACHES.append(cache)
    return cache


def size_cache(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``lru_cache`` for size-only helpers that steps aside while tracing.

    Under ``torch.compile`` / ``torch.export`` sizes may be symbolic and a cache lookup would
    either fail or bake one size into the graph, so the wrapped function is called directly
    and the tracer folds its tensor ops into the graph.
    """

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        @lru_cache(maxsize=maxsize)
        def cached(*args):
            # Cached tensors outlive the call: built under inference_mode they would be
            # inference tensors, unusable by a later training step at the same size.
            with torch.inference_mode(False):
                return fn(*args)

        @wraps(fn)
        def wrapper(*args):
            if is_compiling() or torch.jit.is_tracing():
                return fn(*args)
            return cached(*args)

        wrapper.cache_info = cached.cache_info  # type: ignore[attr-defined]
        wrapper.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        register_cache(cached)
        return wrapper

    return decorate


#: Cached :func:`build_window_layout`, keyed by every argument. Shared by all blocks (and all
#: backbones) that use the same map size, window, shift, device and dtype. An entry holds its
#: mask (15-24 MB at stage 1 of an 800 x 1344 input): more entries would save little and could
#: hold GBs of device memory under multi-scale training (hundreds of batch shapes, 8 layouts each).
get_window_layout = size_cache(maxsize=256)(build_window_layout)


#: Cached :func:`relative_position_index`.
get_relative_position_index = size_cache(maxsize=64)(relative_position_index)


def clear_caches() -> None:
    """Empty every cache of the ops: layouts, indices, image windows, Swin V2's coordinate
    tables (e.g. to free device memory after a size sweep)."""
    for cache in _CACHES:
        cache.cache_clear()
