"""Argument and input checks that fail early with a message naming the argument.

Each check raises ``ValueError("<argument>: expected <what>, got <value>")`` so users never
see a crash deep inside torch (or, worse, a silently wrong result).
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, NoReturn, Optional, Sequence, Tuple, Union

import torch

from .torch_compat import NO_AUTOCAST, autocast_enabled


def fail(name: str, expected: str, got: object) -> NoReturn:
    """Raise ``ValueError("<name>: expected <expected>, got <got!r>")``."""
    raise ValueError(f"{name}: expected {expected}, got {got!r}")


#: Largest ``window_size``: one window's attention holds ``window_size**4`` scores per head
#: (2.7e8 at 128, a 1 GiB fp32 matrix) and, with ``pad_small_map=True``, any smaller feature
#: map is padded up to a whole window, so a larger window cannot run on any input.
MAX_WINDOW_SIZE = 128


def is_int(value: object) -> bool:
    """An integer that is not a bool (Python or numpy ints)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """``int(value)`` if ``value`` is an integer (not a bool, not a float) in ``[minimum, maximum]``."""
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            expected = f"an int in [{minimum}, {maximum}]"
        elif minimum is not None:
            expected = f"an int >= {minimum}"
        else:
            expected = "an int"
        fail(name, expected, value)
    return int(value)  # type: ignore[call-overload]


def check_int_sequence(name: str, value: object, expected: str) -> Tuple[int, ...]:
    """``tuple(value)`` if ``value`` is a list or tuple (not a str, dict or set: their order or
    their items would be silently wrong); the items are checked by the caller."""
    if not isinstance(value, (list, tuple)):
        fail(name, expected, value)
    return tuple(value)  # type: ignore[arg-type]


def check_flag(name: str, value: object) -> None:
    """A switch: ``True`` / ``False`` (or ``0`` / ``1``). A string such as ``'False'`` would be
    truthy and silently switch the option on."""
    if not (isinstance(value, bool) or (is_int(value) and value in (0, 1)) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))):
        fail(name, "True or False", value)


def check_number(name: str, value: object, *, positive: bool = False) -> float:
    """A finite real number (not a bool), ``> 0`` if ``positive``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        fail(name, "a finite number" + (" > 0" if positive else ""), value)
    return float(value)


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
    window_size: Union[int, Sequence[int]],
    mlp_ratio: float,
    drop_rate: float,
    attn_drop_rate: float,
    drop_path_rate: float,
    pretrain_img_size: Sequence[int],
    out_indices: Sequence[int],
    frozen_stages: int,
    qk_scale: Optional[float] = None,
    flags: Optional[Dict[str, object]] = None,
) -> Tuple[int, ...]:
    """Validate :class:`~swin_backbone.SwinBackbone` constructor arguments (``flags``: the
    boolean switches by name); returns the window of each stage."""
    _positive_int("embed_dims", embed_dims)
    _positive_int("in_channels", in_channels)
    _positive_int("patch_size", patch_size)
    if not depths or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths):
        fail("depths", "a non-empty sequence of ints >= 1", depths)
    windows = check_per_stage("window_size", window_size, len(depths), 1, MAX_WINDOW_SIZE,
                              ": one window's attention holds window_size**4 scores per head, and smaller maps "
                              "are padded up to a whole window")
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
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not 0 < mlp_ratio < math.inf:
        fail("mlp_ratio", "a number > 0", mlp_ratio)
    check_model_size(embed_dims, depths, mlp_ratio)
    if qk_scale is not None:
        check_number("qk_scale", qk_scale, positive=True)
    for flag, value in (flags or {}).items():
        check_flag(flag, value)
    _rate("drop_rate", drop_rate)
    _rate("attn_drop_rate", attn_drop_rate)
    _rate("drop_path_rate", drop_path_rate)
    if not isinstance(pretrain_img_size, (list, tuple)) or len(pretrain_img_size) != 2 or any(not isinstance(s, int) or s < patch_size for s in pretrain_img_size):
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
    return windows


def check_per_stage(name: str, value: object, num_stages: int, minimum: int, maximum: Optional[int] = None,
                    why: str = "") -> Tuple[int, ...]:
    """An int or one int per stage, each in ``[minimum, maximum]`` -> ``num_stages`` ints."""
    values = (value,) * num_stages if is_int(value) else value
    bound = f">= {minimum}" if maximum is None else f">= {minimum} and <= {maximum} (in [{minimum}, {maximum}]{why})"
    if (not isinstance(values, (list, tuple)) or len(values) != num_stages
            or any(not is_int(v) or v < minimum or (maximum is not None and v > maximum) for v in values)):
        fail(name, f"an int {bound}, or one per stage ({num_stages} stages)", value)
    return tuple(int(v) for v in values)


#: Largest model the constructor builds: 1e10 parameters (40 GB in fp32; Swin V2-G has 3e9).
MAX_PARAMETERS = 10**10
#: Most blocks over all stages.
MAX_BLOCKS = 1024


def estimated_parameters(embed_dims: int, depths: Sequence[int], mlp_ratio: float) -> int:
    """Roughly the parameters of a Swin model: per block ``(4 + 2 mlp_ratio) C_i**2`` (qkv,
    projection, MLP), per patch merging ``8 C_i**2``."""
    total = 0.0
    for i, depth in enumerate(depths):
        dims = embed_dims * 2**i
        total += depth * (4 + 2 * mlp_ratio) * dims**2 + (8 * dims**2 if i < len(depths) - 1 else 0)
    return int(total)


def check_model_size(embed_dims: int, depths: Sequence[int], mlp_ratio: float) -> None:
    """Refuse sizes whose weights alone could not be allocated, before torch tries."""
    if sum(depths) > MAX_BLOCKS:
        fail("depths", f"at most {MAX_BLOCKS} blocks in all (each is a module built in Python; Swin V2-G has 50)",
             tuple(depths))
    params = estimated_parameters(embed_dims, depths, mlp_ratio)
    if params > MAX_PARAMETERS:
        raise ValueError(
            f"embed_dims / depths / mlp_ratio: expected a model of at most {MAX_PARAMETERS:.0e} parameters, got "
            f"embed_dims={embed_dims}, depths={tuple(depths)}, mlp_ratio={mlp_ratio}: about {params:.1e} "
            f"parameters ({params * 4 / 1e9:.0f} GB in fp32)"
        )


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
    if x.dtype != weight.dtype and (x.device.type in NO_AUTOCAST or not autocast_enabled(x.device.type)):
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
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                fail("valid_sizes", expected, valid_sizes)
            for v in pair:
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    fail("valid_sizes", expected, valid_sizes)
            pairs.append((int(pair[0]), int(pair[1])))
    for h, w in pairs:
        if not (1 <= h <= height and 1 <= w <= width):
            fail("valid_sizes", expected, pairs)
    if pairs.count((height, width)) == len(pairs):
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


# ---------------------------------------------------------------------------- images (FeatureExtractor)
def _value_range(image: torch.Tensor) -> Tuple[float, float]:
    flat = image.detach().reshape(-1)
    if not flat.is_floating_point():
        flat = flat.to(torch.int64)  # (uint16 / uint32 have no min / max kernels)
    return float(flat.min()), float(flat.max())


def check_image(name: str, image: object) -> None:
    """Validate one image for :class:`~swin_backbone.features.FeatureExtractor`: an
    ``(H, W, 3|4)`` / ``(H, W)`` array or a ``(3, H, W)`` tensor of uint8 (or integer) 0..255
    values or finite floats on the 0..255 scale. Floats that look like 0..1 (or already
    normalised) images get a warning: they run, but their features are not the model's."""
    import warnings

    import numpy as np

    if isinstance(image, (str, bytes)) or type(image).__module__.startswith("PIL."):
        fail(name, "an (H, W, 3) uint8 RGB array or a (3, H, W) tensor (read files with "
             "swin_backbone.tools.extraction.read_rgb(path))", type(image).__name__)
    if isinstance(image, np.ndarray):
        if image.ndim == 3 and image.shape[0] in (1, 3) and image.shape[2] not in (3, 4):
            fail(name, "an (H, W, 3) array (channels last; for a (3, H, W) array pass "
                 "image.transpose(1, 2, 0))", f"an array of shape {image.shape}")
        if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            fail(name, "an (H, W, 3) RGB, (H, W, 4) RGBA or (H, W) grey array", f"an array of shape {image.shape}")
        if image.dtype.kind not in "uif":
            fail(name, "uint8 (0..255) or float pixel values", f"an array of dtype {image.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(image))
        shape = tuple(image.shape)
    elif isinstance(image, torch.Tensor):
        shape = tuple(image.shape)
        if image.dim() == 3 and shape[0] != 3 and shape[-1] in (3, 4):
            fail(name, "a (3, H, W) tensor (channels first; for an (H, W, 3) tensor pass "
                 "image.permute(2, 0, 1))", f"a tensor of shape {shape}")
        if image.dim() != 3 or shape[0] != 3:
            fail(name, "a (3, H, W) RGB tensor", f"a tensor of shape {shape}")
        if image.dtype == torch.bool or image.is_complex():
            fail(name, "uint8 (0..255) or float pixel values", f"a tensor of dtype {image.dtype}")
        if image.device.type == "meta":
            fail(name, "a tensor with data (cpu or cuda)", "a tensor on the meta device")
        tensor = image
    else:
        fail(name, "an (H, W, 3) uint8 RGB array or a (3, H, W) tensor", type(image).__name__)
    spatial = shape[:2] if isinstance(image, np.ndarray) else shape[1:]
    if min(spatial) < 1:
        fail(name, "height and width >= 1", f"shape {shape}")
    if tensor.dtype == torch.uint8:
        return
    if not tensor.is_floating_point():
        low, high = _value_range(tensor)
        if low < 0 or high > 255:
            fail(name, "integer pixel values in 0..255 (scale 16-bit images to 8 bits first)",
                 f"{tensor.dtype} values from {low:g} to {high:g}")
        return
    if not bool(torch.isfinite(tensor).all()):
        fail(name, "finite pixel values", "NaN or inf values")
    low, high = _value_range(tensor)
    if 0 < high <= 1 and low >= 0:
        warnings.warn(f"{name}: float values in [0, 1] (max {high:g}); FeatureExtractor expects the 0..255 scale "
                      "(mean/std are in 0..255 units): multiply by 255", UserWarning, stacklevel=4)
    elif low < -1 or high > 256:
        warnings.warn(f"{name}: float values from {low:g} to {high:g}, outside 0..255; FeatureExtractor expects "
                      "unnormalised 0..255 RGB (it subtracts mean and divides by std itself)", UserWarning, stacklevel=4)


#: ``torch.compile`` keyword arguments a backbone's ``compile=dict(...)`` may pass on.
COMPILE_OPTIONS = ("mode", "backend", "fullgraph", "dynamic", "options", "disable")
#: The backbone's own keys of ``compile=dict(...)``: ``regions`` (``False``: the whole backbone compiled).
COMPILE_OWN = ("regions",)


def check_compile(value: object) -> Optional[Dict[str, object]]:
    """The backbone's ``compile``: ``False`` / ``None`` (eager: ``None`` returned), ``True`` or a
    dict of ``torch.compile`` keyword arguments (:data:`COMPILE_OPTIONS`) and ``regions``
    (:data:`COMPILE_OWN`); returns the options with ``dynamic=True`` unless given."""
    if value is None or value is False:
        return None
    if value is True:
        return {"dynamic": True}
    expected = f"a dict of torch.compile options {COMPILE_OPTIONS} and 'regions'"
    if not isinstance(value, dict):
        fail("compile", f"True, False or {expected}", value)
    unknown = sorted(str(k) for k in value if k not in COMPILE_OPTIONS + COMPILE_OWN)
    if unknown:
        fail("compile", expected, f"unknown keys {unknown}")
    for flag in ("fullgraph", "dynamic", "disable", "regions"):
        if flag in value and value[flag] is not None:
            check_flag(f"compile['{flag}']", value[flag])
    if "mode" in value and value["mode"] is not None and not isinstance(value["mode"], str):
        fail("compile['mode']", "a str such as 'default', 'reduce-overhead', 'max-autotune', or None", value["mode"])
    if "backend" in value and not (isinstance(value["backend"], str) or callable(value["backend"])):
        fail("compile['backend']", "a backend name (str, e.g. 'inductor', 'eager') or a callable", value["backend"])
    if "options" in value and value["options"] is not None and not isinstance(value["options"], dict):
        fail("compile['options']", "a dict of backend options or None", value["options"])
    options = {"dynamic": True, **value}
    if options.get("regions") is not None:
        options["regions"] = bool(options["regions"])
    return options
