"""swin-backbone: a Swin Transformer backbone for mmdet 3.x and mmseg 1.x.

Importing the package registers :class:`SwinBackbone` and :class:`SwinV2Backbone` in the
``MODELS`` registry of every installed OpenMMLab library (mmdet, mmseg, mmpretrain), so configs
can use ``custom_imports=dict(imports=['swin_backbone'])`` and ``backbone=dict(type='SwinBackbone')``.
:class:`SwinBlock` / :class:`SwinBlockV2` are exported for FSDP wrap policies (one unit per block:
configs/_base_/fsdp.py, docs/large-models.md). Where mmcv is installed without compiled ops
(mmcv-lite), mmcv gets its ops from torchvision / torch (:mod:`swin_backbone.mmcv_lite`,
docs/mmcv-lite.md) whenever it asks for them, before or after this import.
"""
from . import torch_compat  # noqa: F401  (first: one clear ImportError on a torch below the floor)
from . import mmcv_lite

mmcv_lite.activate()  # the mmcv._ext finder, where no .pth installed it (a checkout on PYTHONPATH)
from .model.backbone import SwinBackbone
from .model.blocks import SwinBlock
from .model.presets import ARCH_SETTINGS
from .model.v2 import SwinBlockV2, SwinV2Backbone
from .checkpoint import CheckpointError, LoadReport, detect_format, load_checkpoint
from .mmlab.optim import BF16AutocastOptimWrapper
from .mmlab.preprocessors import register_preprocessors
from .mmlab.registry import register
from .ops import clear_caches

from ._version import __version__

REGISTERED_IN = register(SwinBackbone)
register(SwinV2Backbone, "SwinV2Backbone")
#: ``SwinDetDataPreprocessor`` / ``SwinSegDataPreProcessor``: per-image valid sizes for the
#: backbone (:mod:`swin_backbone.mmlab.preprocessors`), where mmdet / mmseg are installed.
PREPROCESSORS = register_preprocessors()

__all__ = [
    "ARCH_SETTINGS",
    "BF16AutocastOptimWrapper",
    "CheckpointError",
    "LoadReport",
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
