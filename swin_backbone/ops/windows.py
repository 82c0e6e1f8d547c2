"""Window arithmetic: padding, cyclic shifts, window partition indices, region labels,
attention masks and relative-position indices. Pure functions of sizes (never of weights).

All index and mask tensors are built with tensor ops on ``arange`` (no Python loops over
pixels), which keeps them traceable by ``torch.compile`` / ``torch.export``.

Conventions
-----------
A feature map of ``H x W`` tokens is padded bottom/right to ``Hp x Wp`` (multiples of the
window ``ws``), cyclically shifted by ``-shift`` on both axes (pad first, then shift, as the
official detection code and mmdet do), and cut into ``nW = (Hp // ws) * (Wp // ws)`` windows
of ``N = ws * ws`` tokens each. The *window layout* of a map is the ``(nW * N,)`` sequence of
tokens in window-major order (:mod:`.layouts` holds the gathers between it and the
row-major ``(H * W,)`` order, with the attention mask, per map size).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

#: Additive mask value between tokens of different regions. The pretrained Swins used -100,
#: but exp(-100) = 3.7e-44 is a *denormal* float: every masked attention weight then becomes
#: a denormal, and the matmuls that read them (attention @ V, the output projection, their
#: gradients) run far slower on x86 CPUs (figures in docs/performance.md). exp(-1e4)
#: underflows to exactly 0, which changes results by < 1e-40 and is finite in fp16 and bf16
#: (no -inf, no NaN: a row always keeps its own token).
MASK_VALUE = -1e4

#: Region label given to tokens that exist only because of window padding.
PAD_REGION = 9


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


def effective_window(height: int, width: int, window_size: int, shift_size: int,
                     pad_small_map: bool) -> Tuple[int, int]:
    """Window and shift actually used on an ``height x width`` map.

    With ``pad_small_map=True`` (detection / segmentation, = mmdet) the configured window is
    always used; a smaller map is padded up to it and still shifted. With ``False``
    (= the official classification model) a map whose smaller side is <= the window gets a
    window of that side and no shift.
    """
    if not pad_small_map and min(height, width) <= window_size:
        return min(height, width), 0
    return window_size, shift_size


def output_size(height: int, width: int, patch_size: int, num_stages: int) -> Tuple[Tuple[int, int], ...]:
    """Spatial size of each stage's output for an ``height x width`` image: stage 0 is
    ``ceil(H / patch) x ceil(W / patch)``; each later stage halves it (ceil)."""
    h, w = ceil_div(height, patch_size), ceil_div(width, patch_size)
    sizes = [(h, w)]
    for _ in range(num_stages - 1):
        h, w = ceil_div(h, 2), ceil_div(w, 2)
        sizes.append((h, w))
    return tuple(sizes)


def _rolled_rows(padded: int, shift: int, device: torch.device) -> torch.Tensor:
    """``(padded,)`` int64: for each row of the padded, shifted map, the row of the unshifted map
    it shows (those >= the real size are padding rows)."""
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


def window_token_index(height: int, width: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """Gather index from row-major tokens to the shifted window layout: ``(nW * N,)`` int64 into
    ``H * W + 1`` tokens, where index ``H * W`` denotes a zero padding token appended after the real ones."""
    hp, wp = padded_size(height, window), padded_size(width, window)
    rows, cols = _rolled_rows(hp, shift, device), _rolled_rows(wp, shift, device)
    valid = (rows < height)[:, None] & (cols < width)[None, :]
    src = torch.where(valid, rows[:, None] * width + cols[None, :], height * width)
    return partition_grid(src, window).reshape(-1)


def window_inverse_index(height: int, width: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """Inverse of :func:`window_token_index` on the real tokens: ``(H * W,)`` int64, the position in the
    window layout of each row-major token, so ``layout[inverse]`` undoes partition, shift and padding."""
    hp, wp = padded_size(height, window), padded_size(width, window)
    # Row / column in the shifted map; kept non-negative: the TorchScript ONNX exporter turns
    # integer floor division into a truncating one, which differs for negative numbers.
    r = _mod(torch.arange(height, device=device) + (hp - shift), hp)
    c = _mod(torch.arange(width, device=device) + (wp - shift), wp)
    n_win_w = wp // window
    win = (r[:, None] // window) * n_win_w + (c[None, :] // window)
    pos = _mod(r[:, None], window) * window + _mod(c[None, :], window)
    return (win * window * window + pos).reshape(-1)


def region_labels(
    height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device,
    valid: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """Region id of every token of the padded, shifted map, ``(Hp, Wp)`` int64.

    Tokens may attend to each other only when their ids are equal. Ids 0..8 are the nine
    shift regions; with ``mask_padding`` every padding token gets :data:`PAD_REGION` so that
    real tokens never attend to padding. ``valid = (h, w)`` (with ``mask_padding``): the
    labels of one image that is only the top-left ``h x w`` of the map: every token beyond
    it is padding too.
    """
    height_, width_ = valid if valid is not None else (height, width)
    hp, wp = padded_size(height, window), padded_size(width, window)
    labels = _shift_regions(hp, window, shift, device)[:, None] * 3 + _shift_regions(wp, window, shift, device)[None, :]
    if mask_padding:
        rows, cols = _rolled_rows(hp, shift, device), _rolled_rows(wp, shift, device)
        is_pad = (rows >= height_)[:, None] | (cols >= width_)[None, :]
        labels = labels.masked_fill(is_pad, PAD_REGION)
    return labels


def needs_mask(height: int, width: int, window: int, shift: int, mask_padding: bool) -> bool:
    """Whether any window mixes regions (so attention needs a mask at all)."""
    if shift > 0:
        return True
    return mask_padding and (pad_amount(height, window) > 0 or pad_amount(width, window) > 0)


def window_attention_mask(
    height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device, dtype: torch.dtype,
    align: bool = False,
) -> Optional[torch.Tensor]:
    """Additive attention mask ``(nW, N, N)``: 0 within a region, :data:`MASK_VALUE` across.

    ``None`` when no window needs masking (no shift and no masked padding). With ``align``
    the rows are stored 8-element aligned (a view of an ``(nW, N, ceil8(N))`` buffer), as
    fused CUDA attention kernels read masks without copying them.
    """
    if not needs_mask(height, width, window, shift, mask_padding):
        return None
    return mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)


def row_length(n: int, align: bool) -> int:
    """Stored length of an ``N``-element mask row: ``N``, or ``N`` rounded up to 8 with ``align``."""
    return n + (-n) % 8 if align else n


def mask_buffer(labels: torch.Tensor, dtype: torch.dtype, align: bool) -> torch.Tensor:
    """Additive mask of windows' region labels ``(K, N)``, on their device: :data:`MASK_VALUE`
    between tokens whose labels differ, 0 else.

    Returns the ``(K, N, R)`` buffer (``R``: :func:`row_length`) whose ``[..., :N]`` is the
    mask (:func:`mask_rows`). Copies move the whole buffer, so that the mask's rows stay
    8-aligned on the device.
    """
    differs = labels[:, :, None] != labels[:, None, :]
    n = differs.shape[-1]
    if not align:  # (out of place: the TorchScript ONNX exporter mistranslates in-place writes into views)
        return torch.zeros(differs.shape, device=labels.device, dtype=dtype).masked_fill(differs, MASK_VALUE)
    buffer = torch.zeros(differs.shape[:-1] + (row_length(n, align),), device=labels.device, dtype=dtype)
    buffer.narrow(-1, 0, n).masked_fill_(differs, MASK_VALUE)
    return buffer


def mask_rows(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """The ``(..., N, N)`` mask held by a :func:`mask_buffer` buffer (a view)."""
    return buffer if buffer.shape[-1] == n else buffer.narrow(-1, 0, n)


def mask_from_labels(
    height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device, dtype: torch.dtype,
    align: bool = False,
) -> torch.Tensor:
    """:func:`window_attention_mask` without the ``needs_mask`` check, built on ``device``."""
    labels = partition_grid(region_labels(height, width, window, shift, mask_padding, device), window)
    return mask_rows(mask_buffer(labels, dtype, align), window * window)


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

