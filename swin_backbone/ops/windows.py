"""Window arithmetic: padding, shifts, partition indices, region labels, masks and relative
position indices; pure, traceable functions of sizes (tensor ops on ``arange``).

An ``H x W`` map is padded bottom/right to ``Hp x Wp`` (multiples of ``ws``), shifted by
``-shift`` (pad first, as mmdet), and cut into ``nW`` windows of ``N = ws * ws`` tokens; the
*window layout* is the ``(nW * N,)`` window-major token sequence.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

#: Additive mask between regions. Not the official -100: exp(-100) is a denormal, which makes
#: the matmuls reading masked weights far slower on x86 CPUs (docs/performance.md); exp(-1e4)
#: is exactly 0, and -1e4 is finite in fp16 / bf16.
MASK_VALUE = -1e4

PAD_REGION = 9  #: region label of window padding tokens


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (also symbolic ones while tracing)."""
    return (a + b - 1) // b


def _mod(a: torch.Tensor, b) -> torch.Tensor:
    """Python's ``a % b`` for an integer tensor, as ``a - (a // b) * b``: the ONNX exporter has
    no translation for ``remainder`` by a symbolic size (dynamic H, W), but has one for this."""
    return a - (a // b) * b


def padded_size(size: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` >= ``size`` (written so a tracer sees it divides evenly)."""
    return ceil_div(size, multiple) * multiple


def pad_amount(size: int, multiple: int) -> int:
    """Zeros to append so that ``size`` becomes a multiple of ``multiple`` (:func:`padded_size` ``- size``)."""
    return (size + multiple - 1) // multiple * multiple - size


def output_size(height: int, width: int, patch_size: int, num_stages: int) -> Tuple[Tuple[int, int], ...]:
    """Each stage's ``(h, w)`` for an image: ``ceil(H / patch)``, then halved (ceil) per stage."""
    h, w = ceil_div(height, patch_size), ceil_div(width, patch_size)
    sizes = [(h, w)]
    for _ in range(num_stages - 1):
        h, w = ceil_div(h, 2), ceil_div(w, 2)
        sizes.append((h, w))
    return tuple(sizes)


def _rolled_rows(padded: int, shift: int, device: torch.device) -> torch.Tensor:
    """``(padded,)`` int64: the unshifted row each row of the shifted map shows."""
    return _mod(torch.arange(padded, device=device) + shift, padded)


def _shift_regions(padded: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """Shift-region id of each row, as the official code: ``[0, P-ws)`` 0, ``[P-ws, P-shift)`` 1,
    ``[P-shift, P)`` 2 (regions 1 and 2 came from opposite edges)."""
    rows = torch.arange(padded, device=device)
    if shift == 0:
        return torch.zeros_like(rows)
    return (rows >= padded - window).long() + (rows >= padded - shift).long()


def partition_grid(grid: torch.Tensor, window: int) -> torch.Tensor:
    """``(Hp, Wp)`` grid -> ``(nW, ws * ws)``, by one gather (a tracer need not special-case
    one-window-wide maps as with view + transpose)."""
    hp, wp = grid.shape
    n = window * window
    pos = torch.arange(hp * wp, device=grid.device)
    win, inner = pos // n, _mod(pos, n)
    rows = (win // (wp // window)) * window + inner // window
    cols = _mod(win, wp // window) * window + _mod(inner, window)
    return grid.reshape(-1)[rows * wp + cols].view(-1, n)


def window_token_index(height: int, width: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """``(nW * N,)`` int64 gather from ``H * W + 1`` row-major tokens (``H * W``: padding) to the window layout."""
    hp, wp = padded_size(height, window), padded_size(width, window)
    rows, cols = _rolled_rows(hp, shift, device), _rolled_rows(wp, shift, device)
    valid = (rows < height)[:, None] & (cols < width)[None, :]
    src = torch.where(valid, rows[:, None] * width + cols[None, :], height * width)
    return partition_grid(src, window).reshape(-1)


def window_inverse_index(height: int, width: int, window: int, shift: int, device: torch.device) -> torch.Tensor:
    """``(H * W,)`` int64: the window-layout position of each token (inverse of :func:`window_token_index`)."""
    hp, wp = padded_size(height, window), padded_size(width, window)
    # Kept non-negative: the TorchScript ONNX exporter turns floor division into truncation.
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
    """``(Hp, Wp)`` int64 region ids (0..8 shift regions, :data:`PAD_REGION` for padding with
    ``mask_padding``); ``valid = (h, w)``: tokens beyond that top-left image are padding too."""
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
    """``(nW, N, N)`` additive mask (0 within a region, :data:`MASK_VALUE` across) or ``None``;
    ``align``: rows 8-aligned (fused CUDA kernels then read it without a copy)."""
    if not needs_mask(height, width, window, shift, mask_padding):
        return None
    return mask_from_labels(height, width, window, shift, mask_padding, device, dtype, align)


def row_length(n: int, align: bool) -> int:
    """Stored length of an ``N``-element mask row: ``N``, or ``N`` rounded up to 8 with ``align``."""
    return n + (-n) % 8 if align else n


def mask_buffer(labels: torch.Tensor, dtype: torch.dtype, align: bool) -> torch.Tensor:
    """``(K, N)`` labels -> ``(K, N, R)`` buffer (``R``: :func:`row_length`) whose ``[..., :N]`` is
    the additive mask (:func:`mask_rows`); copy the whole buffer to keep rows aligned."""
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
    """``(N * N,)`` int64 rows of a ``(2*tw-1)**2``-row bias table (``window <= tw``: read exactly)."""
    coords = torch.arange(window, device=device)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    dy = ys[:, None] - ys[None, :] + table_window - 1
    dx = xs[:, None] - xs[None, :] + table_window - 1
    return (dy * (2 * table_window - 1) + dx).reshape(-1)

