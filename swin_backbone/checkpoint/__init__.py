"""Checkpoint files and formats, resizing and loading (see :func:`load_checkpoint`)."""
from . import hooks  # noqa: F401  (backbones convert foreign keys in load_state_dict)
from . import mmengine_schemes
from .base import CheckpointError, to_ours
from .detect import FORMATS, detect_format, unwrap_state_dict
from .files import CheckpointNotFoundError, write_checkpoint
from .loading import LoadReport, load_checkpoint, prepare_state_dict, read_checkpoint

# mmengine's loads of local files, URLs and named references read through the inert unpickler
# (mmdet's / mmseg's tools once a config's custom_imports imported swin_backbone); torch's own
# weights-only list is left as it is (docs/checkpoints.md, "Security model").
mmengine_schemes.register()

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
