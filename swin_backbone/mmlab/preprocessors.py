"""Data preprocessors that hand each image's ``img_shape`` to SwinBackbone: the switch that
makes an image's features independent of how much the batch padded it.

mmdet's ``DetDataPreprocessor`` and mmseg's ``SegDataPreProcessor`` pad every image (to
``pad_size_divisor`` / ``size_divisor``, to the largest image of the batch, to a crop
``size``) before the model runs, and the model calls ``backbone(inputs)`` with the padded
batch alone. :class:`SwinDetDataPreprocessor` and :class:`SwinSegDataPreProcessor` are the
same preprocessors (same arguments, same output) that also attach each image's
``img_shape`` (from its data sample's metainfo, never from pixel values) to the batch tensor
(:func:`~swin_backbone.model.valid_sizes.attach_valid_sizes`); :meth:`SwinBackbone.forward`
uses them as its ``valid_sizes``. Every route into the model goes through the preprocessor
(``train_step`` / ``val_step`` / ``test_step``, ``tools/test.py``, ``DetInferencer`` /
``MMSegInferencer``, ``MMDistributedDataParallel``), so the one config line

    model = dict(data_preprocessor=dict(type='SwinDetDataPreprocessor'))   # mmdet
    model = dict(data_preprocessor=dict(type='SwinSegDataPreProcessor'))   # mmseg

turns it on (the other keys merge from the base config); the library's own type turns it
off. A custom preprocessor can call :func:`attach_img_shapes` at the end of its ``forward``.

``SwinDetDataPreprocessor(buckets=[(H, W), ...])`` also pads each batch up to the smallest of
those shapes (either orientation) that holds it, as mmdet's ``BatchFixedSizePad`` pads (images,
and in training instance masks and segmentation maps; ``batch_input_shape`` / ``pad_shape``
updated), in training and inference: a backbone compiled whole with static shapes then sees a
few shapes only (docs/shape-buckets.md). A batch no bucket holds keeps its shape (logged once).
"""
from __future__ import annotations

import importlib
import logging

from typing import List, Optional, Tuple

from mmengine.logging import print_log

from ..buckets import check_buckets, choose_bucket
from ..model.valid_sizes import attach_valid_sizes

__all__ = ["attach_img_shapes", "img_shapes", "register_preprocessors"]


def img_shapes(data_samples) -> Optional[List[Tuple[int, int]]]:
    """Each data sample's ``img_shape`` ``(h, w)``; ``None`` if any sample lacks one."""
    if not data_samples:
        return None
    sizes = []
    for sample in data_samples:
        shape = sample.metainfo.get("img_shape")
        if shape is None:
            return None
        sizes.append((int(shape[0]), int(shape[1])))
    return sizes


def attach_img_shapes(data: dict) -> dict:
    """``data`` (a preprocessor's output: ``inputs``, ``data_samples``) with the samples'
    ``img_shape`` attached to the batch tensor ``inputs`` as the backbone's valid sizes.

    Batches without data samples (or without ``img_shape``) and non-tensor inputs are
    returned unchanged: the backbone then treats each image as the whole input.
    """
    inputs = data.get("inputs")
    sizes = img_shapes(data.get("data_samples"))
    if sizes is None or not hasattr(inputs, "dim") or inputs.dim() != 4 or len(sizes) != inputs.shape[0]:
        return data
    return dict(data, inputs=attach_valid_sizes(inputs, sizes))


def pad_to_bucket(preprocessor, data: dict, training: bool) -> dict:
    """``data`` (``DetDataPreprocessor``'s output) with its batch padded to the smallest of the
    ``preprocessor.buckets`` holding it, by mmdet's ``BatchFixedSizePad`` with the preprocessor's
    pad values; unchanged where no bucket holds it (logged once per shape)."""
    from mmdet.models.data_preprocessors import BatchFixedSizePad

    inputs = data["inputs"]
    height, width = inputs.shape[-2:]
    bucket = choose_bucket(height, width, preprocessor.buckets)
    if bucket is None:
        if (height, width) not in preprocessor.unbucketed:
            preprocessor.unbucketed.add((height, width))
            print_log(f"{type(preprocessor).__name__}: a {height}x{width} batch fits none of the buckets "
                      f"{list(preprocessor.buckets)} (either orientation): it keeps its shape (a graph of its own)",
                      logger="current", level=logging.WARNING)
        return data
    if bucket == (height, width):
        return data
    pad = BatchFixedSizePad(bucket, img_pad_value=preprocessor.pad_value,
                            pad_mask=training and preprocessor.pad_mask, mask_pad_value=preprocessor.mask_pad_value,
                            pad_seg=training and preprocessor.pad_seg, seg_pad_value=preprocessor.seg_pad_value)
    inputs, samples = pad(inputs, data.get("data_samples"))
    return dict(data, inputs=inputs, data_samples=samples)


def _with_img_shapes(base: type, name: str, buckets: bool = False) -> type:
    """A subclass of the preprocessor ``base`` whose ``forward`` attaches the image shapes (and
    with ``buckets``, takes a ``buckets`` argument: :func:`pad_to_bucket`)."""

    def forward(self, data: dict, training: bool = False) -> dict:
        data = base.forward(self, data, training)
        if buckets and self.buckets:
            data = pad_to_bucket(self, data, training)
        return attach_img_shapes(data)

    def __init__(self, *args, buckets: Optional[List[Tuple[int, int]]] = None, **kwargs) -> None:
        base.__init__(self, *args, **kwargs)
        self.buckets = check_buckets(buckets)
        self.unbucketed = set()  # (batch shapes no bucket holds, logged)

    forward.__doc__ = f"``{base.__name__}.forward``, then :func:`attach_img_shapes`."
    doc = (
        f"``{base.__name__}`` that also hands each image's ``img_shape`` to SwinBackbone as its "
        "valid size (:mod:`swin_backbone.mmlab.preprocessors`); same arguments"
        + (", and ``buckets``: ``(H, W)`` batch shapes to pad up to (:func:`pad_to_bucket`)." if buckets else ".")
    )
    members = {"forward": forward, "__doc__": doc, "__module__": __name__}
    if buckets:
        members["__init__"] = __init__
    return type(name, (base,), members)


#: (module, class) of each library's preprocessor, its registry module, our subclass's name, and
#: whether it takes ``buckets`` (mmseg's crops have one shape already).
_PREPROCESSORS = (
    ("mmdet.models.data_preprocessors", "DetDataPreprocessor", "mmdet.registry", "SwinDetDataPreprocessor", True),
    ("mmseg.models.data_preprocessor", "SegDataPreProcessor", "mmseg.registry", "SwinSegDataPreProcessor", False),
)


def register_preprocessors() -> List[str]:
    """Define and register the preprocessors in each installed library's ``MODELS``.

    Returns the names registered (``SwinDetDataPreprocessor`` with mmdet,
    ``SwinSegDataPreProcessor`` with mmseg).
    """
    done = []
    for base_module, base_name, registry_module, name, buckets in _PREPROCESSORS:
        try:
            base = getattr(importlib.import_module(base_module), base_name)
            registry = importlib.import_module(registry_module).MODELS
        except ImportError:
            continue
        cls = _with_img_shapes(base, name, buckets)
        globals()[name] = cls
        registry.register_module(name=name, module=cls, force=True)
        done.append(name)
    return done
