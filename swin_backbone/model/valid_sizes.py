"""Per-image valid sizes carried by a batch tensor from the data preprocessor to the backbone.

mmdet's and mmseg's models call ``backbone(inputs)`` with the padded batch alone; the data
samples that know each image's ``img_shape`` never reach it. The data preprocessors of
:mod:`swin_backbone.mmlab.preprocessors` therefore *attach* the sizes to the batch tensor they
return (:func:`attach_valid_sizes`), and :meth:`SwinBackbone.forward` reads them
(:func:`read_valid_sizes`) when it is not given ``valid_sizes`` itself.

The sizes travel with that very tensor object (an attribute of it, so nothing outlives the
batch and no other tensor ever picks them up): through the model's ``forward``, DDP (which
passes a tensor already on its device unchanged) and ``extract_feat``. A *view* of it that
keeps its batch and channels, such as mmseg's slide-inference crops
``inputs[:, :, y1:y2, x1:x2]``, gets the part of each image inside the crop, computed from
the view's offset into the batch (never from pixel values). Any other tensor (a copy, a
resized batch) carries nothing and runs as the whole input, as without the preprocessor.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

import torch
from mmengine.logging import print_log
from torch import nn

from ..ops import Sizes, tracing

#: Attribute of the batch tensor holding the sizes.
ATTRIBUTE = "_swin_valid_sizes"

def attach_valid_sizes(inputs: torch.Tensor, sizes: Sequence[Sequence[int]]) -> torch.Tensor:
    """Attach per-image valid ``(h, w)`` (input pixels, top-left) to a ``(B, C, H, W)`` batch.

    Returns ``inputs`` itself, or a copy of it if it is a view (the crop arithmetic of
    :func:`read_valid_sizes` reads offsets relative to the batch's own storage).
    """
    if inputs.dim() != 4 or len(sizes) != inputs.shape[0]:
        raise ValueError(
            f"valid_sizes: expected one (h, w) per image of the (B, C, H, W) batch {tuple(inputs.shape)}, "
            f"got {list(sizes)!r}"
        )
    if inputs._base is not None or not inputs.is_contiguous():
        inputs = inputs.contiguous() if not inputs.is_contiguous() else inputs.clone()
    height, width = inputs.shape[-2:]
    # An image's img_shape never exceeds the batch, except where a preprocessor cropped the
    # batch below it (never with mmdet / mmseg): clip to what is there.
    setattr(inputs, ATTRIBUTE, tuple((min(int(h), height), min(int(w), width)) for h, w in sizes))
    return inputs


def read_valid_sizes(x: torch.Tensor, model: Optional[nn.Module] = None) -> Optional[Sizes]:
    """The valid sizes attached to ``x`` (or to the batch ``x`` is a crop view of), else None;
    None too while a tracer records the forward (sizes are per batch: they run eagerly).

    For a crop ``batch[:, :, y1:y2, x1:x2]`` each image's size becomes the part of it inside
    the crop, ``(clip(h - y1, 0, y2 - y1), clip(w - x1, 0, x2 - x1))``; an image with no
    pixel inside the crop runs as the whole crop (only padding is predicted there, which
    mmseg's post-processing discards).

    ``model``: the backbone about to read them. One that reproduces the libraries' padding
    semantics (``mask_padding=False`` / ``pad_small_map=False``) attends to batch padding, as
    its user asked: the sizes are ignored (None), which it says once.
    """
    if tracing():
        return None
    sizes = getattr(x, ATTRIBUTE, None)
    if sizes is None and x._base is not None:  # (a view: perhaps a crop of a batch)
        sizes = _crop_sizes(x)
    if sizes is not None and model is not None and not (model.mask_padding and model.pad_small_map):
        if not getattr(model, "_said_sizes_ignored", False):
            model._said_sizes_ignored = True
            print_log(
                "SwinBackbone: the image sizes attached by the data preprocessor are ignored because "
                f"mask_padding={model.mask_padding}, pad_small_map={model.pad_small_map} reproduce mmdet / mmseg, "
                "where batch padding is attended to (image-exact features need both True)",
                logger="current", level=logging.WARNING,
            )
        return None
    return sizes


def _crop_sizes(x: torch.Tensor) -> Optional[Sizes]:
    """The sizes of the batch ``x`` is a crop view of, within the crop (:func:`read_valid_sizes`)."""
    base = x._base
    if getattr(base, ATTRIBUTE, None) is None:
        return None
    offset = _crop_offset(x, base)
    if offset is None:
        return None
    top, left = offset
    height, width = x.shape[-2:]
    out = []
    for h, w in getattr(base, ATTRIBUTE):
        h, w = min(max(h - top, 0), height), min(max(w - left, 0), width)
        out.append((height, width) if h == 0 or w == 0 else (h, w))
    return tuple(out)


def _crop_offset(x: torch.Tensor, base: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(y1, x1)`` if ``x`` is ``base[:, :, y1:y1 + h, x1:x1 + w]`` of a contiguous NCHW
    ``base``, else None."""
    if x.dim() != 4 or base.dim() != 4 or not base.is_contiguous():
        return None
    if tuple(x.shape[:2]) != tuple(base.shape[:2]) or x.stride() != base.stride():
        return None
    offset = x.storage_offset() - base.storage_offset()
    row = base.stride(2)
    if offset < 0 or offset >= row * base.shape[2]:
        return None
    top, left = divmod(offset, row)
    if top + x.shape[2] > base.shape[2] or left + x.shape[3] > base.shape[3]:
        return None
    return top, left
