"""Checkpoint files and formats, resizing and loading (see :func:`load_checkpoint`)."""
from . import hooks  # noqa: F401  (backbones convert foreign keys in load_state_dict)
from .allowlist import allow_mmengine_checkpoints
from .base import CheckpointError, to_ours
from .detect import FORMATS, detect_format, unwrap_state_dict
from .files import CheckpointNotFoundError, write_checkpoint
from .loading import LoadReport, load_checkpoint, prepare_state_dict, read_checkpoint

# mmengine Runner checkpoints load weights-only in every library of the process (mmdet's / mmseg's
# tools once a config's custom_imports imported swin_backbone): data classes and one restricted
# stand-in, safe for any torch.load (allowlist.py, docs/checkpoints.md).
allow_mmengine_checkpoints()

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
