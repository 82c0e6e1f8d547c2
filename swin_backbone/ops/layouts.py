"""Window layouts of a map size, the one owner of the ops' caches, and the token gathers.

A :class:`WindowLayout` holds, for one map size, window and shift, the gathers between
row-major tokens and the window layout and the attention mask (:mod:`.windows` computes
them). Layouts depend only on sizes, so they are cached (:func:`get_window_layout`); every
cache of the ops is made by :func:`size_cache` or registered with :func:`register_cache`,
and :func:`clear_caches` empties them all.

No host-device synchronisation in a forward: eagerly, whatever needs values on the host
(``nonzero``, tensors from Python lists) is computed on the CPU, and each result moves to the
target device with one non-blocking copy (:func:`to_device`). A layout builds each of its
tensors when a kernel first reads it (the fused Triton kernel reads none). A layout built
while tracing (``tracing=True``, sizes possibly symbolic) has all its tensors built at once
with plain ops on the device, and its gathers use only ops the tracer knows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache, wraps
from typing import Callable, Dict, List, Optional, TypeVar

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
            (8-aligned rows with ``align``, as :func:`window_attention_mask`).
        rows: ``(K * N,)`` the row of the batch's flat ``(B * H * W)`` row-major tokens that
            each position of those windows holds (the image's token 0 for window padding),
            for kernels that read and write row-major tokens (the fused Triton one).
        real: ``(R,)`` the positions among the ``K * N`` that hold real tokens.
        real_rows: ``(R,)`` their rows, ``rows[real]`` (where results are written back).
    """

    windows: torch.Tensor
    masks: torch.Tensor
    rows: Optional[torch.Tensor] = None
    real: Optional[torch.Tensor] = None
    real_rows: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class WindowLayout:
    """Everything a window-attention block needs for one map size, window and shift; its tensors
    are built when first read, then kept (see the module docstring).

    Attributes:
        height, width, window, shift: real map size ``H, W``; effective window and shift.
        has_padding: whether the window layout holds padding tokens (zeros).
        padding_masked: padding tokens are masked out of attention (``mask_padding``), so
            the values they carry cannot change any real token's result.
        device, dtype, align: where the tensors live; the mask's dtype (the compute dtype) and
            whether its rows are stored 8-aligned (:func:`window_attention_mask`).
        tensors: the tensors built so far, by name (below). One dict shared by the layout
            and its ``dataclasses.replace`` copies, so that what one builds serves all.
        images: the windows that the boundaries of a batch's images cut (per-image valid
            sizes, :func:`~.image_sizes.get_image_windows`), or ``None``: every image fills the map.
        traced: built while tracing (all tensors at once; gathers in plain ops).

    Tensors (properties):
        index: ``(nW * N,)`` gather from ``H * W (+1 pad)`` tokens to the window layout.
        inverse: ``(H * W,)`` gather from the window layout back to row-major tokens.
        pad_slots: ``(nP,)`` positions of the padding tokens in the window layout, zeroed after
            the gather (no padded copy of the input; :func:`gather_tokens`); ``None`` while tracing.
        mask: ``(nW, N, N)`` additive mask in the compute dtype, or ``None``.
        masked_windows: ``(nM,)`` indices of the windows whose mask is not all zeros, or
            ``None`` (unknown while tracing: then every window uses ``mask``). Shift
            regions and padding only ever meet in the last row and column of windows, so
            attention can run on all windows with the shared bias alone and redo just these.
        window_masks: ``mask[masked_windows]``, ``(nM, N, N)``.
    """

    height: int
    width: int
    window: int
    shift: int
    has_padding: bool
    padding_masked: bool
    device: torch.device
    dtype: torch.dtype
    align: bool
    tensors: Dict[str, Optional[torch.Tensor]] = field(repr=False, compare=False)
    images: Optional[ImageWindows] = None
    traced: bool = False

    def _tensor(self, name: str) -> Optional[torch.Tensor]:
        """The tensor ``name``, built (with the others its builder makes) on first use."""
        if name not in self.tensors:
            # Kept with a cached layout, as the cache's own builds: no inference tensors.
            with torch.inference_mode(False):
                self.tensors.update(_LAYOUT_BUILDERS[name](self))
        return self.tensors[name]

    @property
    def index(self) -> torch.Tensor:
        return self._tensor("index")  # type: ignore[return-value]

    @property
    def inverse(self) -> torch.Tensor:
        return self._tensor("inverse")  # type: ignore[return-value]

    @property
    def pad_slots(self) -> Optional[torch.Tensor]:
        return self._tensor("pad_slots")

    @property
    def mask(self) -> Optional[torch.Tensor]:
        return self._tensor("mask")

    @property
    def masked_windows(self) -> Optional[torch.Tensor]:
        return self._tensor("masked_windows")

    @property
    def window_masks(self) -> Optional[torch.Tensor]:
        return self._tensor("window_masks")

    def to_windows(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H * W, C)`` row-major tokens -> ``(B, nW * N, C)`` window layout (no autograd
        node of its own; see :func:`window_partition`)."""
        return gather_tokens(x, self.index, self.has_padding, self.pad_slots, self.traced)

    def to_tokens(self, windows: torch.Tensor) -> torch.Tensor:
        """``(B, nW * N, C)`` window layout -> ``(B, H * W, C)`` row-major tokens."""
        return gather_tokens(windows, self.inverse, False, None, self.traced)

    @property
    def num_windows(self) -> int:
        return ceil_div(self.height, self.window) * ceil_div(self.width, self.window)


def _build_gathers(layout: WindowLayout) -> Dict[str, Optional[torch.Tensor]]:
    """``index``, ``inverse`` and ``pad_slots`` of an eagerly built layout: computed on the
    CPU (``nonzero`` there reads no device memory), one copy each to the layout's device."""
    height, width, window, shift, device = layout.height, layout.width, layout.window, layout.shift, layout.device
    index = window_token_index(height, width, window, shift, CPU)
    pad_slots = None
    if layout.has_padding:
        is_pad = index == height * width
        pad_slots = to_device(is_pad.nonzero().squeeze(1), device)
        index = index.masked_fill(is_pad, 0)
    return {
        "index": to_device(index, device),
        "inverse": to_device(window_inverse_index(height, width, window, shift, CPU), device),
        "pad_slots": pad_slots,
    }


def _build_masks(layout: WindowLayout) -> Dict[str, Optional[torch.Tensor]]:
    """``mask`` and ``masked_windows`` of an eagerly built layout: computed on the CPU, one
    copy each to the layout's device (the mask's whole 8-aligned buffer)."""
    height, width, window, shift = layout.height, layout.width, layout.window, layout.shift
    if not needs_mask(height, width, window, shift, layout.padding_masked):
        return {"mask": None, "masked_windows": None}
    labels = partition_grid(region_labels(height, width, window, shift, layout.padding_masked, CPU), window)
    # A window's mask is all zeros exactly where all its tokens share one region.
    masked = (labels != labels[:, :1]).any(1).nonzero().squeeze(1)
    buffer = to_device(mask_buffer(labels, layout.dtype, layout.align), layout.device)
    return {"mask": mask_rows(buffer, window * window), "masked_windows": to_device(masked, layout.device)}


def _build_window_masks(layout: WindowLayout) -> Dict[str, Optional[torch.Tensor]]:
    """``window_masks``: gathered on the device from ``mask`` and ``masked_windows``."""
    mask = layout.mask
    return {"window_masks": None if mask is None else mask.index_select(0, layout.masked_windows)}


#: Which builder makes each of a layout's tensors (and the others it makes with it).
_LAYOUT_BUILDERS: Dict[str, Callable[[WindowLayout], Dict[str, Optional[torch.Tensor]]]] = {
    "index": _build_gathers, "inverse": _build_gathers, "pad_slots": _build_gathers,
    "mask": _build_masks, "masked_windows": _build_masks, "window_masks": _build_window_masks,
}


def build_window_layout(
    height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device, dtype: torch.dtype,
    align: bool = False, tracing: bool = False,
) -> WindowLayout:
    """A :class:`WindowLayout` (uncached; see :func:`get_window_layout`). Eagerly, no tensor is built here.

    While tracing (``tracing``: the plan's), sizes may be symbolic and whether a size needs
    padding is not known, so the layout then always allows for it (a zero token that may go
    unused, a mask that may be all zeros): one graph serves every size. Its tensors are built
    here, with plain ops on ``device`` (the tracer records them).
    """
    if window <= 0 or not 0 <= shift < window:
        raise ValueError(f"window must be > 0 and 0 <= shift < window, got window={window}, shift={shift}")
    device = torch.device(device)
    sizes = dict(height=height, width=width, window=window, shift=shift, padding_masked=mask_padding,
                 device=device, dtype=dtype, align=align, traced=tracing)
    if tracing or not isinstance(height, int) or not isinstance(width, int):
        mask = None
        if shift > 0 or mask_padding:
            mask = mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)
        tensors = {"index": window_token_index(height, width, window, shift, device),
                   "inverse": window_inverse_index(height, width, window, shift, device),
                   "pad_slots": None, "mask": mask, "masked_windows": None, "window_masks": None}
        return WindowLayout(has_padding=True, tensors=tensors, **dict(sizes, traced=True))
    has_padding = pad_amount(height, window) > 0 or pad_amount(width, window) > 0
    return WindowLayout(has_padding=has_padding, tensors={}, **sizes)


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
            if is_compiling():
                return fn(*args)
            return cached(*args)

        wrapper.cache_info = cached.cache_info  # type: ignore[attr-defined]
        wrapper.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        register_cache(cached)
        return wrapper

    return decorate


#: Cached :func:`build_window_layout`, keyed by every argument. Shared by all blocks (and all
#: backbones) that use the same map size, window, shift, device and dtype. Not larger: a miss
#: costs no device work where the fused Triton kernel runs (it reads no layout tensor) and no
#: host-device synchronisation anywhere, while an entry that SDPA reads holds its mask (15-24 MB
#: at stage 1 of an 800 x 1344 input): more entries would save little and could hold GBs of
#: device memory under multi-scale training (hundreds of batch shapes, 8 layouts each).
get_window_layout = size_cache(maxsize=256)(build_window_layout)


#: Cached :func:`relative_position_index`.
get_relative_position_index = size_cache(maxsize=64)(relative_position_index)


def clear_caches() -> None:
    """Empty every cache of the ops: layouts, indices, image windows, Swin V2's coordinate
    tables, the planner's and the fused kernel's answers (e.g. to free device memory after a
    size sweep). The measured kernel decisions are not a cache: :func:`.kernel_choice.forget`."""
    for cache in _CACHES:
        cache.cache_clear()


class _TokenGather(torch.autograd.Function):
    """``gather_tokens(x, index, pad_in, pad_slots)`` whose backward is a gather too.

    ``index`` and ``inverse`` are mutually inverse on the real tokens (each real token occurs
    exactly once in the window layout), so the gradient is a plain gather with ``inverse``
    instead of ``index_select``'s scatter-add, which is several times slower on CPU.
    """

    @staticmethod
    def forward(ctx, x, index, inverse, pad_slots, pad_in: bool, pad_out: bool):
        ctx.save_for_backward(inverse, pad_slots)
        ctx.pad_out = pad_out
        return gather_tokens(x, index, pad_in, pad_slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, pad_slots = ctx.saved_tensors
        return gather_tokens(grad, inverse, ctx.pad_out, pad_slots), None, None, None, None, None


def gather_tokens(x: torch.Tensor, index: torch.Tensor, pad: bool, pad_slots: Optional[torch.Tensor],
                  traced: bool = False) -> torch.Tensor:
    """``(B, L, C)`` -> ``(B, len(index), C)``, with zeros at the padding slots if ``pad``.

    Padding slots are ``pad_slots`` (``index`` reads any real token there, then the slots are
    zeroed), or, when ``pad_slots`` is ``None`` (tracing), ``index == L`` (a zero token is
    appended to ``x`` first).
    """
    if pad and pad_slots is None:
        return torch.nn.functional.pad(x, (0, 0, 0, 1)).index_select(1, index)
    batch, length, channels = x.shape
    if traced:
        out = x.index_select(1, index)
    else:
        # index_select along dim 1 runs single-threaded on CPU; along dim 0 of the flattened
        # (B * L, C) rows it is a parallel row copy.
        rows = index if batch == 1 else (index + torch.arange(0, batch * length, length, device=index.device)[:, None])
        out = x.reshape(batch * length, channels).index_select(0, rows.view(-1)).view(batch, -1, channels)
    return out.index_fill_(1, pad_slots, 0) if pad else out


def window_partition(x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """Pad, shift and partition ``(B, H * W, C)`` row-major tokens in one gather: ``(B, nW * N, C)``
    tokens in window layout, padding tokens zeros."""
    if layout.traced:  # plain ops for the tracer
        return layout.to_windows(x)
    return _TokenGather.apply(x, layout.index, layout.inverse, layout.pad_slots, layout.has_padding, False)


def window_reverse(windows: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """Inverse of :func:`window_partition`: un-partition, un-shift and crop in one gather,
    ``(B, nW * N, C)`` window layout -> ``(B, H * W, C)`` row-major tokens."""
    if layout.traced:
        return layout.to_tokens(windows)
    return _TokenGather.apply(windows, layout.inverse, layout.index, layout.pad_slots, False, layout.has_padding)

