"""swin-backbone: a Swin Transformer backbone for mmdet 3.x and mmseg 1.x.

After ``import swin_backbone``, :class:`SwinBackbone` and :class:`SwinV2Backbone` build from the
``MODELS`` registry of every installed OpenMMLab library (mmdet, mmseg, mmpretrain), so configs
can use ``custom_imports=dict(imports=['swin_backbone'])`` and ``backbone=dict(type='SwinBackbone')``.
The import itself costs little more than ``import torch``: the classes, and mmengine's models and
the libraries' behind them, load when first used (a name of this package, or a registry lookup:
:mod:`swin_backbone.mmlab`). :class:`SwinBlock` / :class:`SwinBlockV2` are exported for FSDP
wrap policies (one unit per block: configs/_base_/fsdp.py, docs/large-models.md). Where mmcv is
installed without compiled ops (mmcv-lite), mmcv gets its ops from torchvision / torch
(:mod:`swin_backbone.mmcv_lite`, docs/mmcv-lite.md) whenever it asks for them, before or after
this import.
"""

from . import torch_compat  # noqa: F401  (first: one clear ImportError on a torch below the floor)
from ._lazy import lazy_names as _lazy_names
from . import mmcv_lite
from . import mmlab
from ._version import __version__

mmcv_lite.activate()  # the mmcv._ext finder, where no .pth installed it (a checkout on PYTHONPATH)
mmlab.plug_in()  # registry locations, config scope, checkpoint reader: read when mmengine needs them

#: The public names, by the module that defines them (imported on first use, PEP 562).
_LAZY = {
    "SwinBackbone": "model.backbone",
    "SwinBlock": "model.blocks",
    "ARCH_SETTINGS": "model.presets",
    "SwinBlockV2": "model.v2",
    "SwinV2Backbone": "model.v2",
    "CheckpointError": "checkpoint",
    "LoadReport": "checkpoint",
    "detect_format": "checkpoint",
    "load_checkpoint": "checkpoint",
    "BF16AutocastOptimWrapper": "mmlab.optim",
    "register": "mmlab.registry",
    #: the libraries whose ``MODELS`` hold SwinBackbone (registering, where not done yet).
    "REGISTERED_IN": "mmlab.registry",
    #: ``SwinDetDataPreprocessor`` / ``SwinSegDataPreProcessor``: per-image valid sizes for the
    #: backbone (:mod:`swin_backbone.mmlab.preprocessors`), where mmdet / mmseg are installed.
    "PREPROCESSORS": "mmlab.registry",
    "clear_caches": "ops",
}

__all__ = [
    "ARCH_SETTINGS",
    "BF16AutocastOptimWrapper",
    "CheckpointError",
    "LoadReport",
    "PREPROCESSORS",
    "REGISTERED_IN",
    "SwinBackbone",
    "SwinBlock",
    "SwinBlockV2",
    "SwinV2Backbone",
    "clear_caches",
    "detect_format",
    "load_checkpoint",
    "register",
    "__version__",
]


__getattr__, __dir__ = _lazy_names(__name__, _LAZY)
