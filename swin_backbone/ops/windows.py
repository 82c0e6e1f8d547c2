"""Window arithmetic: padding, shifted-window token layouts and attention masks.

Everything here depends only on sizes (never on weights), so it is computed once per input
size and cached. All index and mask tensors are built with tensor ops on ``arange`` (no Python
loops over pixels), which keeps them traceable by ``torch.compile`` / ``torch.export``.

No host-device synchronisation in a forward: eagerly, whatever needs values on the host
(``nonzero``, tensors from Python lists) is computed on the CPU, and each result moves to the
target device with one non-blocking copy (:func:`_to_device`). A :class:`WindowLayout` builds
each of its tensors when a kernel first reads it (the fused Triton kernel reads none). While
tracing, sizes may be symbolic: layouts are then built with plain ops on the device, eagerly.

Conventions
-----------
A feature map of ``H x W`` tokens is padded bottom/right to ``Hp x Wp`` (multiples of the
window ``ws``), cyclically shifted by ``-shift`` on both axes (pad first, then shift, as the
official detection code and mmdet do), and cut into ``nW = (Hp // ws) * (Wp // ws)`` windows
of ``N = ws * ws`` tokens each. The *window layout* of a map is the ``(nW * N,)`` sequence of
tokens in window-major order; :class:`WindowLayout` holds the gather indices between the
row-major ``(H * W,)`` order and that layout, and the attention mask for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache, wraps
from typing import Callable, Dict, Optional, Tuple, TypeVar

import torch
import torch.nn.functional as F

from ..torch_compat import is_compiling

T = TypeVar("T")

#: Additive mask value between tokens of different regions. The pretrained Swins used -100,
#: but exp(-100) = 3.7e-44 is a *denormal* float: every masked attention weight then becomes
#: a denormal, and the matmuls that read them (attention @ V, the output projection, their
#: gradients) run far slower on x86 CPUs (figures in docs/performance.md). exp(-1e4) underflows to exactly 0, which changes results by < 1e-40 and is
#: finite in fp16 and bf16 (no -inf, no NaN: a row always keeps its own token).
MASK_VALUE = -1e4

#: Region label given to tokens that exist only because of window padding.
PAD_REGION = 9

_CPU = torch.device("cpu")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
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


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (also symbolic ones while tracing)."""
    return (a + b - 1) // b


def _mod(a: torch.Tensor, b) -> torch.Tensor:
    """Python's ``a % b`` for an integer tensor, as ``a - (a // b) * b``: the ONNX exporter has
    no translation for ``remainder`` by a symbolic size (dynamic H, W), but has one for this."""
    return a - (a // b) * b


def padded_size(size: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``size``.

    Written as ``ceil(size / multiple) * multiple`` so that a tracer can see that the result
    divides evenly (``size + (-size) % multiple`` hides that behind a modulo).
    """
    return ceil_div(size, multiple) * multiple


def pad_amount(size: int, multiple: int) -> int:
    """Zeros to append so that ``size`` becomes a multiple of ``multiple``."""
    return padded_size(size, multiple) - size


def effective_window(
    height: int, width: int, window_size: int, shift_size: int, pad_small_map: bool
) -> Tuple[int, int]:
    """Window and shift actually used on an ``height x width`` map.

    With ``pad_small_map=True`` (detection / segmentation, = mmdet) the configured window is
    always used; a smaller map is padded up to it and still shifted. With ``False``
    (= the official classification model) a map whose smaller side is <= the window gets a
    window of that side and no shift.
    """
    if not pad_small_map and min(height, width) <= window_size:
        return min(height, width), 0
    return window_size, shift_size


def _rolled_rows(size: int, padded: int, shift: int, device: torch.device) -> torch.Tensor:
    """For each row of the padded, shifted map, the row of the unshifted map it shows.

    Returns ``(padded,)`` int64; values >= ``size`` are padding rows.
    """
    return _mod(torch.arange(padded, device=device) + shift, padded)


def _shift_regions(padded: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """Shift-region id (0, 1, 2) of each row of a shifted map, as in the official code.

    Rows ``[0, P-ws)`` are region 0, ``[P-ws, P-shift)`` region 1, ``[P-shift, P)`` region 2:
    after the cyclic shift, tokens of regions 1 and 2 came from opposite edges of the map
    and must not attend to each other.
    """
    rows = torch.arange(padded, device=device)
    if shift == 0:
        return torch.zeros_like(rows)
    return (rows >= padded - window).long() + (rows >= padded - shift).long()


def partition_grid(grid: torch.Tensor, window: int) -> torch.Tensor:
    """``(Hp, Wp)`` grid -> ``(nW, ws * ws)`` rows of its windows, window-major.

    Computed as one gather with arithmetic indices rather than view + transpose, so that a
    tracer does not have to special-case maps that are one window wide.
    """
    hp, wp = grid.shape
    n = window * window
    pos = torch.arange(hp * wp, device=grid.device)
    win, inner = pos // n, _mod(pos, n)
    rows = (win // (wp // window)) * window + inner // window
    cols = _mod(win, wp // window) * window + _mod(inner, window)
    return grid.reshape(-1)[rows * wp + cols].view(-1, n)


def window_token_index(
    height: int, width: int, window: int, shift: int, device: torch.device
) -> torch.Tensor:
    """Gather index from row-major tokens to the shifted window layout.

    Returns ``(nW * N,)`` int64 into ``H * W + 1`` tokens, where index ``H * W`` denotes a
    zero padding token appended after the real ones.
    """
    hp, wp = padded_size(height, window), padded_size(width, window)
    rows = _rolled_rows(height, hp, shift, device)
    cols = _rolled_rows(width, wp, shift, device)
    valid = (rows < height)[:, None] & (cols < width)[None, :]
    src = torch.where(valid, rows[:, None] * width + cols[None, :], height * width)
    return partition_grid(src, window).reshape(-1)


def window_inverse_index(
    height: int, width: int, window: int, shift: int, device: torch.device
) -> torch.Tensor:
    """Inverse of :func:`window_token_index` on the real tokens.

    Returns ``(H * W,)`` int64: the position in the window layout of each row-major token,
    so ``layout[inverse]`` undoes partition, shift and padding in one gather.
    """
    hp, wp = padded_size(height, window), padded_size(width, window)
    r = _mod(torch.arange(height, device=device) - shift, hp)  # row in the shifted map
    c = _mod(torch.arange(width, device=device) - shift, wp)
    n_win_w = wp // window
    win = (r[:, None] // window) * n_win_w + (c[None, :] // window)
    pos = _mod(r[:, None], window) * window + _mod(c[None, :], window)
    return (win * window * window + pos).reshape(-1)


def region_labels(
    height: int,
    width: int,
    window: int,
    shift: int,
    mask_padding: bool,
    device: torch.device,
    valid: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """Region id of every token of the padded, shifted map, ``(Hp, Wp)`` int64.

    Tokens may attend to each other only when their ids are equal. Ids 0..8 are the nine
    shift regions; with ``mask_padding`` every padding token gets :data:`PAD_REGION` so that
    real tokens never attend to padding. ``valid = (h, w)`` (with ``mask_padding``): the
    labels of one image that is only the top-left ``h x w`` of the map: every token beyond
    it is padding too.
    """
    if valid is not None:
        height_, width_ = valid
    else:
        height_, width_ = height, width
    hp, wp = padded_size(height, window), padded_size(width, window)
    labels = (
        _shift_regions(hp, window, shift, device)[:, None] * 3
        + _shift_regions(wp, window, shift, device)[None, :]
    )
    if mask_padding:
        rows = _rolled_rows(height, hp, shift, device)
        cols = _rolled_rows(width, wp, shift, device)
        is_pad = (rows >= height_)[:, None] | (cols >= width_)[None, :]
        labels = labels.masked_fill(is_pad, PAD_REGION)
    return labels


def needs_mask(height: int, width: int, window: int, shift: int, mask_padding: bool) -> bool:
    """Whether any window mixes regions (so attention needs a mask at all)."""
    if shift > 0:
        return True
    return mask_padding and (pad_amount(height, window) > 0 or pad_amount(width, window) > 0)


def window_attention_mask(
    height: int,
    width: int,
    window: int,
    shift: int,
    mask_padding: bool,
    device: torch.device,
    dtype: torch.dtype,
    align: bool = False,
) -> Optional[torch.Tensor]:
    """Additive attention mask ``(nW, N, N)``: 0 within a region, :data:`MASK_VALUE` across.

    ``None`` when no window needs masking (no shift and no masked padding). With ``align``
    the rows are stored 8-element aligned (a view of an ``(nW, N, ceil8(N))`` buffer), as
    fused CUDA attention kernels read masks without copying them.
    """
    if not needs_mask(height, width, window, shift, mask_padding):
        return None
    return _mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)


def _row_length(n: int, align: bool) -> int:
    """Stored length of an ``N``-element mask row: ``N``, or ``N`` rounded up to 8 with ``align``."""
    return n + (-n) % 8 if align else n


def _mask_buffer(labels: torch.Tensor, dtype: torch.dtype, align: bool) -> torch.Tensor:
    """Additive mask of windows' region labels ``(K, N)``, on their device: :data:`MASK_VALUE`
    between tokens whose labels differ, 0 else.

    Returns the ``(K, N, R)`` buffer (``R``: :func:`_row_length`) whose ``[..., :N]`` is the
    mask (:func:`_mask_rows`). Copies move the whole buffer, so that the mask's rows stay
    8-aligned on the device.
    """
    differs = labels[:, :, None] != labels[:, None, :]
    n = differs.shape[-1]
    buffer = torch.zeros(differs.shape[:-1] + (_row_length(n, align),), device=labels.device, dtype=dtype)
    buffer.narrow(-1, 0, n).masked_fill_(differs, MASK_VALUE)
    return buffer


def _mask_rows(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """The ``(..., N, N)`` mask held by a :func:`_mask_buffer` buffer (a view)."""
    return buffer if buffer.shape[-1] == n else buffer.narrow(-1, 0, n)


def _mask_from_labels(
    height: int,
    width: int,
    window: int,
    shift: int,
    mask_padding: bool,
    device: torch.device,
    dtype: torch.dtype,
    align: bool = False,
) -> torch.Tensor:
    """:func:`window_attention_mask` without the ``needs_mask`` check, built on ``device``."""
    labels = partition_grid(region_labels(height, width, window, shift, mask_padding, device), window)
    return _mask_rows(_mask_buffer(labels, dtype, align), window * window)


def relative_position_index(window: int, table_window: int, device: torch.device) -> torch.Tensor:
    """Index into a ``(2*tw-1)**2``-row relative-position-bias table for a ``window`` window.

    Returns ``(N * N,)`` int64 with ``N = window**2``. ``window`` may be smaller than the
    table's window ``tw`` (``pad_small_map=False`` on small maps): its offsets are a subset
    of the table's, so the bias is read exactly, with no resizing.
    """
    coords = torch.arange(window, device=device)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    dy = ys[:, None] - ys[None, :] + table_window - 1
    dx = xs[:, None] - xs[None, :] + table_window - 1
    return (dy * (2 * table_window - 1) + dx).reshape(-1)


@dataclass(frozen=True)
class WindowLayout:
    """Everything a window-attention block needs for one map size, window and shift.

    The tensors are built when a kernel first reads them, then kept with the layout (the
    fused Triton kernel computes regions from coordinates and reads none of them); while
    tracing they are all built with the layout.

    Attributes:
        height, width: real map size ``H, W``.
        window, shift: effective window and shift.
        has_padding: whether the window layout holds padding tokens (zeros).
        padding_masked: padding tokens are masked out of attention (``mask_padding``), so
            the values they carry cannot change any real token's result.
        device: where the tensors live.
        dtype, align: the mask's dtype (the compute dtype) and whether its rows are stored
            8-aligned (:func:`window_attention_mask`).
        tensors: the tensors built so far, by name (below). One dict shared by the layout
            and its ``dataclasses.replace`` copies, so that what one builds serves all.
        images: the windows that the boundaries of a batch's images cut (per-image valid
            sizes, :func:`get_image_windows`), or ``None``: every image fills the map.

    Tensors (properties):
        index: ``(nW * N,)`` gather from ``H * W (+1 pad)`` tokens to the window layout.
        inverse: ``(H * W,)`` gather from the window layout back to row-major tokens.
        pad_slots: ``(nP,)`` positions of the padding tokens in the window layout, where
            ``index`` reads token 0 and the gather then writes zeros (no padded copy of the
            input); ``None`` while tracing, where ``index`` reads an appended zero token
            ``H * W`` instead.
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
    images: Optional["ImageWindows"] = None

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
        return gather_tokens(x, self.index, self.has_padding, self.pad_slots)

    def to_tokens(self, windows: torch.Tensor) -> torch.Tensor:
        """``(B, nW * N, C)`` window layout -> ``(B, H * W, C)`` row-major tokens."""
        return gather_tokens(windows, self.inverse, False, None)

    @property
    def num_windows(self) -> int:
        return ceil_div(self.height, self.window) * ceil_div(self.width, self.window)


def _build_gathers(layout: WindowLayout) -> Dict[str, Optional[torch.Tensor]]:
    """``index``, ``inverse`` and ``pad_slots`` of an eagerly built layout: computed on the
    CPU (``nonzero`` there reads no device memory), one copy each to the layout's device."""
    height, width, window, shift, device = layout.height, layout.width, layout.window, layout.shift, layout.device
    index = window_token_index(height, width, window, shift, _CPU)
    pad_slots = None
    if layout.has_padding:
        is_pad = index == height * width
        pad_slots = _to_device(is_pad.nonzero().squeeze(1), device)
        index = index.masked_fill(is_pad, 0)
    return {
        "index": _to_device(index, device),
        "inverse": _to_device(window_inverse_index(height, width, window, shift, _CPU), device),
        "pad_slots": pad_slots,
    }


def _build_masks(layout: WindowLayout) -> Dict[str, Optional[torch.Tensor]]:
    """``mask`` and ``masked_windows`` of an eagerly built layout: computed on the CPU, one
    copy each to the layout's device (the mask's whole 8-aligned buffer)."""
    height, width, window, shift = layout.height, layout.width, layout.window, layout.shift
    if not needs_mask(height, width, window, shift, layout.padding_masked):
        return {"mask": None, "masked_windows": None}
    labels = partition_grid(region_labels(height, width, window, shift, layout.padding_masked, _CPU), window)
    # A window's mask is all zeros exactly where all its tokens share one region.
    masked = (labels != labels[:, :1]).any(1).nonzero().squeeze(1)
    buffer = _to_device(_mask_buffer(labels, layout.dtype, layout.align), layout.device)
    return {"mask": _mask_rows(buffer, window * window), "masked_windows": _to_device(masked, layout.device)}


def _build_window_masks(layout: WindowLayout) -> Dict[str, Optional[torch.Tensor]]:
    """``window_masks``: gathered on the device from ``mask`` and ``masked_windows``."""
    mask = layout.mask
    return {"window_masks": None if mask is None else mask.index_select(0, layout.masked_windows)}


#: Which builder makes each of a layout's tensors (and the others it makes with it).
_LAYOUT_BUILDERS: Dict[str, Callable[[WindowLayout], Dict[str, Optional[torch.Tensor]]]] = {
    "index": _build_gathers,
    "inverse": _build_gathers,
    "pad_slots": _build_gathers,
    "mask": _build_masks,
    "masked_windows": _build_masks,
    "window_masks": _build_window_masks,
}


def build_window_layout(
    height: int,
    width: int,
    window: int,
    shift: int,
    mask_padding: bool,
    device: torch.device,
    dtype: torch.dtype,
    align: bool = False,
) -> WindowLayout:
    """A :class:`WindowLayout` (uncached; see :func:`get_window_layout`).

    ``dtype`` is the mask's (the compute dtype); ``align`` stores mask rows 8-aligned.
    Eagerly, no tensor is built here: each is built on the CPU and copied to ``device`` when
    first read (no host-device synchronisation, nothing for kernels that read none).

    While tracing with symbolic sizes, whether a size needs padding is not known, so the
    layout then always allows for it (a zero token that may go unused, a mask that may be
    all zeros): one graph serves every size. Its tensors are built here, with plain ops on
    ``device`` (the tracer records them).
    """
    if window <= 0 or not 0 <= shift < window:
        raise ValueError(f"window must be > 0 and 0 <= shift < window, got window={window}, shift={shift}")
    device = torch.device(device)
    sizes = dict(height=height, width=width, window=window, shift=shift, padding_masked=mask_padding,
                 device=device, dtype=dtype, align=align)
    if is_compiling() or not isinstance(height, int) or not isinstance(width, int):
        mask = None
        if shift > 0 or mask_padding:
            mask = _mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)
        tensors = {
            "index": window_token_index(height, width, window, shift, device),
            "inverse": window_inverse_index(height, width, window, shift, device),
            "pad_slots": None,
            "mask": mask,
            "masked_windows": None,
            "window_masks": None,
        }
        return WindowLayout(has_padding=True, tensors=tensors, **sizes)
    has_padding = pad_amount(height, window) > 0 or pad_amount(width, window) > 0
    return WindowLayout(has_padding=has_padding, tensors={}, **sizes)


# ---------------------------------------------------------------- per-image valid sizes
#: Per image of a batch, the ``(h, w)`` that is the image on a map; ``None``: all fill it.
ValidSizes = Optional[Tuple[Tuple[int, int], ...]]


@dataclass(frozen=True)
class ImageWindows:
    """Windows of a batch whose mask differs per image: those an image's boundary cuts.

    An image that is only the top-left ``h x w`` of a batch map treats every token beyond
    it as padding (:func:`region_labels` with ``valid``). That changes the mask only of the
    windows holding both tokens of the image and tokens beyond it; windows wholly beyond
    the image keep the shared mask (nothing of the image reads their results).

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


def image_window_masks(
    height: int,
    width: int,
    window: int,
    shift: int,
    valid: Tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
    align: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The windows of an ``height x width`` map that an image of ``valid = (h, w)`` cuts.

    Padding is masked (``mask_padding=True``). Returns ``(k,)`` window indices and their
    ``(k, N, N)`` masks: the windows holding a token of the image and a token of the map
    beyond it, whose per-image labels thus differ from the shared ones. Computed on the CPU
    (``nonzero`` there reads no device memory), one copy each to ``device``.
    """
    own = partition_grid(region_labels(height, width, window, shift, True, _CPU, valid), window)
    shared = partition_grid(region_labels(height, width, window, shift, True, _CPU), window)
    cut = (own != shared).any(1) & (own != PAD_REGION).any(1)
    windows = cut.nonzero().squeeze(1)
    buffer = _mask_buffer(own.index_select(0, windows), dtype, align)
    return _to_device(windows, device), _mask_rows(_to_device(buffer, device), window * window)


def image_windows(
    height: int,
    width: int,
    window: int,
    shift: int,
    valid_sizes: Tuple[Tuple[int, int], ...],
    device: torch.device,
    dtype: torch.dtype,
    align: bool = False,
) -> Optional[ImageWindows]:
    """:class:`ImageWindows` of a batch whose image ``b`` is the top-left ``valid_sizes[b]``
    of the ``height x width`` map; ``None`` where no image's boundary cuts a window.

    Images that fill the map contribute nothing (they use the shared masks). Computed on the
    CPU from the images' CPU masks (``nonzero`` there reads no device memory), one copy per
    tensor to ``device``.
    """
    num_windows = (padded_size(height, window) // window) * (padded_size(width, window) // window)
    windows, masks = [], []
    for b, valid in enumerate(valid_sizes):
        if tuple(valid) == (height, width):
            continue
        # The CPU entries: the windows' indices are read on the host below.
        index, mask = get_image_window_masks(height, width, window, shift, tuple(valid), _CPU, dtype, align)
        if index.numel():
            windows.append(index + b * num_windows)
            masks.append(mask)
    if not windows:
        return None
    n = window * window
    masks = torch.cat(masks)  # dense rows: into a buffer of their own, aligned as the shared ones
    buffer = torch.zeros(masks.shape[:-1] + (_row_length(n, align),), dtype=dtype)
    buffer.narrow(-1, 0, n).copy_(masks)
    windows = torch.cat(windows)
    # Row-major rows of the windows' positions (window_token_index marks padding H * W).
    tokens = height * width
    slots = ((windows % num_windows)[:, None] * n + torch.arange(n)).reshape(-1)
    source = window_token_index(height, width, window, shift, _CPU).index_select(0, slots)
    real = source < tokens
    first = (windows // num_windows).repeat_interleave(n) * tokens
    rows = first + torch.where(real, source, torch.zeros_like(source))
    real = real.nonzero().squeeze(1)
    return ImageWindows(
        windows=_to_device(windows, device),
        masks=_mask_rows(_to_device(buffer, device), n),
        rows=_to_device(rows, device),
        real=_to_device(real, device),
        real_rows=_to_device(rows.index_select(0, real), device),
    )


def stage_valid_sizes(
    valid_sizes: Tuple[Tuple[int, int], ...], patch_size: int, num_stages: int
) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """Per stage, per image, the valid size on the stage's map (:func:`output_size` of each
    image's valid size in input pixels): ``(num_stages, B)`` pairs."""
    per_image = [output_size(h, w, patch_size, num_stages) for h, w in valid_sizes]
    return tuple(tuple(sizes[i] for sizes in per_image) for i in range(num_stages))


def valid_token_mask(
    height: int, width: int, valid_sizes: Tuple[Tuple[int, int], ...], device: torch.device
) -> torch.Tensor:
    """``(B, H, W)`` bool: True where the token lies inside its image's valid size.

    The ``(B, 2)`` sizes go to ``device`` with one non-blocking copy (``torch.tensor(...,
    device=cuda)`` would make the host wait for the copy)."""
    sizes = _to_device(torch.tensor(valid_sizes, dtype=torch.long).view(-1, 2), device)
    rows = torch.arange(height, device=device)[None, :, None] < sizes[:, 0, None, None]
    cols = torch.arange(width, device=device)[None, None, :] < sizes[:, 1, None, None]
    return rows & cols


def zero_beyond_valid(
    x: torch.Tensor, valid_sizes: Tuple[Tuple[int, int], ...], height_dim: int, inplace: bool
) -> torch.Tensor:
    """Zero every element of ``x`` beyond its image's valid ``(h, w)``.

    Args:
        x: a batch-first map whose height and width are dims ``height_dim`` and
            ``height_dim + 1`` (``(B, C, H, W)``: 2; ``(B, H, W, C)``: 1).
        inplace: write into ``x`` (only the regions beyond the images are touched); else
            return a new tensor (autograd-friendly).
    """
    height, width = x.shape[height_dim], x.shape[height_dim + 1]
    if not inplace:
        keep = valid_token_mask(height, width, valid_sizes, x.device)
        keep = keep.view(keep.shape[:1] + (1,) * (height_dim - 1) + keep.shape[1:] + (1,) * (x.dim() - height_dim - 2))
        return x.masked_fill(~keep, 0)
    for b, (h, w) in enumerate(valid_sizes):
        if h < height:
            x[b].narrow(height_dim - 1, h, height - h).zero_()
        if w < width:
            x[b].narrow(height_dim - 1, 0, h).narrow(height_dim, w, width - w).zero_()
    return x


def straddles(
    valid_sizes: Tuple[Tuple[int, int], ...], height: int, width: int, cell: int
) -> Tuple[Tuple[int, int, int, int, int], ...]:
    """What ``cell x cell`` cells straddling an image's edge read beyond the image.

    A cell holding both pixels (tokens) of image ``b`` and pixels beyond it reads, alone,
    zero padding there; every other cell beyond the image only feeds tokens that the image
    never attends to (its own region) and that are zeroed in the outputs. So zeroing these
    boxes is all that makes the batch read what the image alone reads.

    Returns:
        ``(b, row0, row1, col0, col1)`` boxes (non-empty, inside the ``height x width`` map):
        rows ``h .. ceil(h / cell) * cell`` under the image's cells, and columns
        ``w .. ceil(w / cell) * cell`` beside its rows.
    """
    boxes = []
    for b, (h, w) in enumerate(valid_sizes):
        h_end, w_end = min(ceil_div(h, cell) * cell, height), min(ceil_div(w, cell) * cell, width)
        if h < h_end:
            boxes.append((b, h, h_end, 0, w_end))
        if w < w_end:
            boxes.append((b, 0, h, w, w_end))
    return tuple(boxes)


def zero_straddles_(
    x: torch.Tensor, valid_sizes: Tuple[Tuple[int, int], ...], height_dim: int, cell: int
) -> torch.Tensor:
    """Zero, in place, the :func:`straddles` boxes of a batch-first map whose height and
    width are dims ``height_dim`` and ``height_dim + 1``. Returns ``x``."""
    height, width = x.shape[height_dim], x.shape[height_dim + 1]
    for b, r0, r1, c0, c1 in straddles(valid_sizes, height, width, cell):
        x[b].narrow(height_dim - 1, r0, r1 - r0).narrow(height_dim, c0, c1 - c0).zero_()
    return x


def merge_2x2(x: torch.Tensor, valid_sizes: "ValidSizes" = None) -> torch.Tensor:
    """Concatenate each 2x2 cell of a ``(B, H, W, C)`` map: ``(B, ceil(H / 2), ceil(W / 2), 4C)``.

    Odd sizes are zero-padded bottom / right. Channel block ``k = 2 * dw + dh`` holds the
    cell's token ``(dh, dw)``: ``x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]``
    (the official order). With per-image ``valid_sizes`` (on this map), the tokens beyond an
    image that a cell straddling its edge reads are zero in the result (:func:`straddles`),
    as they are alone; ``x`` itself is never written.
    """
    b, h, w, c = x.shape
    h2, w2 = ceil_div(h, 2), ceil_div(w, 2)
    x = F.pad(x, (0, 0, 0, 2 * w2 - w, 0, 2 * h2 - h))
    # (B, h2, dh, w2, dw, C) -> (B, h2, w2, dw, dh, C); the reshape copies (dh and dw swap).
    merged = x.view(b, h2, 2, w2, 2, c).permute(0, 1, 3, 4, 2, 5).reshape(b, h2, w2, 4 * c)
    if valid_sizes is not None:
        cells = merged.view(b, h2, w2, 2, 2, c)
        for i, r0, r1, c0, c1 in straddles(valid_sizes, h, w, 2):
            if c0 == 0:  # row r0 below an odd height: dh = 1 of the cells in its row
                cells[i, r0 // 2, : ceil_div(c1, 2), :, 1].zero_()
            else:  # column c0 right of an odd width: dw = 1 of the cells in its column
                cells[i, : ceil_div(r1, 2), c0 // 2, 1].zero_()
    return merged


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

#: Cached :func:`image_window_masks`, per map size, window, shift and one image's valid size.
get_image_window_masks = size_cache(maxsize=512)(image_window_masks)

#: Cached :func:`image_windows`, per map size, window, shift and a whole batch's valid sizes.
get_image_windows = size_cache(maxsize=128)(image_windows)


def clear_caches() -> None:
    """Drop every cached layout and index (e.g. to free device memory after a size sweep)."""
    get_window_layout.cache_clear()
    get_relative_position_index.cache_clear()
    get_image_window_masks.cache_clear()
    get_image_windows.cache_clear()


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


def gather_tokens(x: torch.Tensor, index: torch.Tensor, pad: bool, pad_slots: Optional[torch.Tensor]) -> torch.Tensor:
    """``(B, L, C)`` -> ``(B, len(index), C)``, with zeros at the padding slots if ``pad``.

    Padding slots are ``pad_slots`` (``index`` reads any real token there, then the slots are
    zeroed), or, when ``pad_slots`` is ``None`` (tracing), ``index == L`` (a zero token is
    appended to ``x`` first).
    """
    if pad and pad_slots is None:
        return torch.nn.functional.pad(x, (0, 0, 0, 1)).index_select(1, index)
    batch, length, channels = x.shape
    if is_compiling():
        out = x.index_select(1, index)
    else:
        # index_select along dim 1 runs single-threaded on CPU; along dim 0 of the flattened
        # (B * L, C) rows it is a parallel row copy.
        rows = index if batch == 1 else (index + torch.arange(0, batch * length, length, device=index.device)[:, None])
        out = x.reshape(batch * length, channels).index_select(0, rows.view(-1)).view(batch, -1, channels)
    return out.index_fill_(1, pad_slots, 0) if pad else out


def window_partition(x: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """Pad, shift and partition row-major tokens in one gather.

    Args:
        x: ``(B, H * W, C)`` tokens of an ``H x W`` map.
    Returns:
        ``(B, nW * N, C)`` tokens in window layout; padding tokens are zeros.
    """
    if is_compiling():  # plain ops for the tracer
        return gather_tokens(x, layout.index, layout.has_padding, layout.pad_slots)
    return _TokenGather.apply(x, layout.index, layout.inverse, layout.pad_slots, layout.has_padding, False)


def window_reverse(windows: torch.Tensor, layout: WindowLayout) -> torch.Tensor:
    """Inverse of :func:`window_partition`: un-partition, un-shift and crop in one gather.

    Args:
        windows: ``(B, nW * N, C)`` tokens in window layout.
    Returns:
        ``(B, H * W, C)`` row-major tokens.
    """
    if is_compiling():
        return gather_tokens(windows, layout.inverse, False, None)
    return _TokenGather.apply(windows, layout.inverse, layout.index, layout.pad_slots, False, layout.has_padding)


def output_size(height: int, width: int, patch_size: int, num_stages: int) -> Tuple[Tuple[int, int], ...]:
    """Spatial size of each stage's output for an ``height x width`` image.

    Stage 0 is ``ceil(H / patch) x ceil(W / patch)``; each later stage halves it (ceil).
    """
    h, w = ceil_div(height, patch_size), ceil_div(width, patch_size)
    sizes = [(h, w)]
    for _ in range(num_stages - 1):
        h, w = ceil_div(h, 2), ceil_div(w, 2)
        sizes.append((h, w))
    return tuple(sizes)


__all__ = [
    "ImageWindows",
    "MASK_VALUE",
    "PAD_REGION",
    "ValidSizes",
    "get_image_window_masks",
    "get_image_windows",
    "image_window_masks",
    "image_windows",
    "stage_valid_sizes",
    "valid_token_mask",
    "zero_beyond_valid",
    "zero_straddles_",
    "straddles",
    "merge_2x2",
    "WindowLayout",
    "build_window_layout",
    "ceil_div",
    "clear_caches",
    "gather_tokens",
    "effective_window",
    "get_relative_position_index",
    "get_window_layout",
    "needs_mask",
    "output_size",
    "pad_amount",
    "padded_size",
    "partition_grid",
    "region_labels",
    "size_cache",
    "relative_position_index",
    "window_attention_mask",
    "window_inverse_index",
    "window_partition",
    "window_reverse",
    "window_token_index",
]
