"""Argument and input checks that fail early with a message naming the argument.

Each check raises ``ValueError("<argument>: expected <what>, got <value>")`` so users never
see a crash deep inside torch (or, worse, a silently wrong result).
"""
from __future__ import annotations

import numbers
from typing import NoReturn, Optional, Sequence, Tuple

import torch

from ..torch_compat import autocast_enabled


def fail(name: str, expected: str, got: object) -> NoReturn:
    """Raise ``ValueError("<name>: expected <expected>, got <got!r>")``."""
    raise ValueError(f"{name}: expected {expected}, got {got!r}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(name, "an int >= 1", value)


def _rate(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        fail(name, "a float in [0, 1)", value)


def check_config(
    *,
    embed_dims: int,
    depths: Tuple[int, ...],
    num_heads: Tuple[int, ...],
    in_channels: int,
    patch_size: int,
    window_size: int,
    mlp_ratio: float,
    drop_rate: float,
    attn_drop_rate: float,
    drop_path_rate: float,
    pretrain_img_size: Sequence[int],
    out_indices: Sequence[int],
    frozen_stages: int,
) -> None:
    """Validate :class:`~swin_backbone.SwinBackbone` constructor arguments."""
    _positive_int("embed_dims", embed_dims)
    _positive_int("in_channels", in_channels)
    _positive_int("patch_size", patch_size)
    _positive_int("window_size", window_size)
    if not depths or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths):
        fail("depths", "a non-empty sequence of ints >= 1", depths)
    if len(num_heads) != len(depths):
        fail("num_heads", f"one entry per stage ({len(depths)} stages)", num_heads)
    for i, heads in enumerate(num_heads):
        _positive_int(f"num_heads[{i}]", heads)
        dims = embed_dims * 2**i
        if dims % heads:
            raise ValueError(
                f"num_heads[{i}]: expected a divisor of stage {i}'s channels "
                f"(embed_dims * 2**{i} = {dims}), got {heads}"
            )
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or mlp_ratio <= 0:
        fail("mlp_ratio", "a number > 0", mlp_ratio)
    _rate("drop_rate", drop_rate)
    _rate("attn_drop_rate", attn_drop_rate)
    _rate("drop_path_rate", drop_path_rate)
    if len(pretrain_img_size) != 2 or any(not isinstance(s, int) or s < patch_size for s in pretrain_img_size):
        fail("pretrain_img_size", f"an int, (S,) or (H, W) of ints >= patch_size ({patch_size})", pretrain_img_size)
    num_stages = len(depths)
    if (
        not isinstance(out_indices, tuple)
        or not out_indices
        or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_stages for i in out_indices)
        or len(set(out_indices)) != len(out_indices)
    ):
        fail("out_indices", f"a non-empty sequence of distinct stage indices in [0, {num_stages - 1}]", out_indices)
    if isinstance(frozen_stages, bool) or not isinstance(frozen_stages, int) or not -1 <= frozen_stages <= num_stages:
        fail("frozen_stages", f"an int in [-1, {num_stages}] (-1 freezes nothing)", frozen_stages)


def check_input(x: object, in_channels: int, weight: torch.Tensor) -> None:
    """Validate a backbone input against the model's channels, device and dtype."""
    if not isinstance(x, torch.Tensor):
        fail("input", "a torch.Tensor of shape (B, C, H, W)", type(x).__name__)
    if x.dim() != 4:
        raise ValueError(f"input: expected a 4-D (B, C, H, W) tensor, got {x.dim()}-D with shape {tuple(x.shape)}")
    b, c, h, w = x.shape
    if c != in_channels:
        raise ValueError(
            f"input: expected {in_channels} channels (in_channels), got {c} in shape {tuple(x.shape)}"
            + (" (channels-last NHWC data? permute it to NCHW)" if x.shape[-1] == in_channels else "")
        )
    if b == 0 or h == 0 or w == 0:
        raise ValueError(f"input: expected batch, height and width >= 1, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(
            f"input: expected a floating-point tensor, got {x.dtype} "
            "(convert images with x.float() and normalise them first)"
        )
    if x.device != weight.device:
        raise ValueError(f"input: expected a tensor on the model's device {weight.device}, got {x.device}")
    if x.dtype != weight.dtype and not autocast_enabled(x.device.type):
        raise ValueError(
            f"input: expected dtype {weight.dtype} (the model's), got {x.dtype}; "
            "cast the input or run under torch.autocast"
        )


def check_valid_sizes(
    valid_sizes: object, shape: Sequence[int], *, mask_padding: bool, pad_small_map: bool
) -> Optional[Tuple[Tuple[int, int], ...]]:
    """Validate ``SwinBackbone.forward``'s ``valid_sizes`` against the input ``shape``.

    Accepts ``None``, a sequence of ``B`` ``(h, w)`` int pairs or a ``(B, 2)`` integer tensor,
    each ``1 <= h <= H``, ``1 <= w <= W``. Returns the sizes as a tuple of int pairs, or
    ``None`` when there are none or every image is the whole input (today's path, exactly).
    """
    if valid_sizes is None:
        return None
    b, _, height, width = shape
    expected = f"None, or {b} (h, w) int pairs (a sequence or a ({b}, 2) int tensor) with 1 <= h <= {height}, 1 <= w <= {width}"
    if isinstance(valid_sizes, torch.Tensor):
        if valid_sizes.is_floating_point() or valid_sizes.is_complex() or valid_sizes.dtype == torch.bool:
            fail("valid_sizes", f"an integer tensor ({expected})", f"a {valid_sizes.dtype} tensor")
        if tuple(valid_sizes.shape) != (b, 2):
            fail("valid_sizes", expected, f"a tensor of shape {tuple(valid_sizes.shape)}")
        pairs = [tuple(int(v) for v in row) for row in valid_sizes.tolist()]
    elif isinstance(valid_sizes, (str, bytes)) or not isinstance(valid_sizes, Sequence):
        fail("valid_sizes", expected, valid_sizes)
    else:
        if len(valid_sizes) != b:
            fail("valid_sizes", expected, f"{len(valid_sizes)} entries {list(valid_sizes)!r}")
        pairs = []
        for pair in valid_sizes:
            if isinstance(pair, torch.Tensor) and pair.dim() == 1 and not pair.is_floating_point():
                pair = pair.tolist()
            if (
                isinstance(pair, (str, bytes))
                or not isinstance(pair, Sequence)
                or len(pair) != 2
                or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in pair)
            ):
                fail("valid_sizes", expected, valid_sizes)
            pairs.append((int(pair[0]), int(pair[1])))
    for h, w in pairs:
        if not (1 <= h <= height and 1 <= w <= width):
            fail("valid_sizes", expected, pairs)
    if all(p == (height, width) for p in pairs):
        # Checked anyway: a config that cannot honour valid sizes should fail the same way
        # whatever the batch.
        pairs_ok = None
    else:
        pairs_ok = tuple(pairs)
    if not mask_padding:
        raise ValueError(
            "valid_sizes: needs mask_padding=True (padding as its own attention region); "
            "mask_padding=False reproduces mmdet, where padding is attended to (sizes attached by "
            "SwinDetDataPreprocessor / SwinSegDataPreProcessor: use the library's own preprocessor type)"
        )
    if not pad_small_map:
        raise ValueError(
            "valid_sizes: needs pad_small_map=True; with pad_small_map=False the window shrinks "
            "with each image's own size, which one batch cannot hold (sizes attached by "
            "SwinDetDataPreprocessor / SwinSegDataPreProcessor: use the library's own preprocessor type)"
        )
    return pairs_ok
