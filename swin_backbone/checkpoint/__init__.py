"""Checkpoint files and formats, resizing and loading (see :func:`load_checkpoint`).

``import swin_backbone.checkpoint`` loads none of its modules: the names below load on first use
(PEP 562), as :mod:`swin_backbone`'s do, so a tool that needs the formats alone
(``swin-convert-checkpoint --help``) does not import the model, mmengine's runner or the
libraries. What this package plugs into others, :mod:`swin_backbone.mmlab`'s notes plug once
they are imported (now where they are already):

- mmengine's loads of local files, URLs and named references read through the inert unpickler
  once ``mmengine.runner.checkpoint`` is imported (:mod:`.mmengine_schemes`; mmdet's / mmseg's
  tools once a config's custom_imports imported swin_backbone); torch's own weights-only list
  is left as it is (docs/checkpoints.md, "Security model");
- the backbones convert foreign keys in ``load_state_dict``, and ``init_cfg=dict(type='Pretrained')``
  reads any format, once ``swin_backbone.model.backbone`` is imported (:mod:`.hooks`).
"""
from .._lazy import lazy_names as _lazy_names

#: The public names, by the module that defines them (imported on first use, PEP 562).
_LAZY = {
    "CheckpointError": "base",
    "to_ours": "base",
    "FORMATS": "detect",
    "detect_format": "detect",
    "unwrap_state_dict": "detect",
    "CheckpointNotFoundError": "files",
    "write_checkpoint": "files",
    "LoadReport": "loading",
    "load_checkpoint": "loading",
    "prepare_state_dict": "loading",
    "read_checkpoint": "loading",
}

__all__ = [
    "FORMATS",
    "CheckpointError",
    "CheckpointNotFoundError",
    "LoadReport",
    "detect_format",
    "load_checkpoint",
    "prepare_state_dict",
    "read_checkpoint",
    "to_ours",
    "unwrap_state_dict",
    "write_checkpoint",
]


__getattr__, __dir__ = _lazy_names(__name__, _LAZY)
