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
"""
from __future__ import annotations

import importlib

from typing import List, Optional, Tuple

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


def _with_img_shapes(base: type, name: str) -> type:
    """A subclass of the preprocessor ``base`` whose ``forward`` attaches the image shapes."""

    def forward(self, data: dict, training: bool = False) -> dict:
        return attach_img_shapes(base.forward(self, data, training))

    forward.__doc__ = f"``{base.__name__}.forward``, then :func:`attach_img_shapes`."
    doc = (
        f"``{base.__name__}`` that also hands each image's ``img_shape`` to SwinBackbone as its "
        "valid size (:mod:`swin_backbone.mmlab.preprocessors`); same arguments."
    )
    return type(name, (base,), {"forward": forward, "__doc__": doc, "__module__": __name__})


#: (module, class) of each library's preprocessor, its registry module, and our subclass's name.
_PREPROCESSORS = (
    ("mmdet.models.data_preprocessors", "DetDataPreprocessor", "mmdet.registry", "SwinDetDataPreprocessor"),
    ("mmseg.models.data_preprocessor", "SegDataPreProcessor", "mmseg.registry", "SwinSegDataPreProcessor"),
)


def register_preprocessors() -> List[str]:
    """Define and register the preprocessors in each installed library's ``MODELS``.

    Returns the names registered (``SwinDetDataPreprocessor`` with mmdet,
    ``SwinSegDataPreProcessor`` with mmseg).
    """
    done = []
    for base_module, base_name, registry_module, name in _PREPROCESSORS:
        try:
            base = getattr(importlib.import_module(base_module), base_name)
            registry = importlib.import_module(registry_module).MODELS
        except ImportError:
            continue
        cls = _with_img_shapes(base, name)
        globals()[name] = cls
        registry.register_module(name=name, module=cls, force=True)
        done.append(name)
    return done
