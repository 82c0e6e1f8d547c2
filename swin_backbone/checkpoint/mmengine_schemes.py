"""mmengine's checkpoint loads through this package's reader.

mmengine's ``CheckpointLoader`` picks a loader by the path's prefix: its extension point.
:func:`register` (run by ``import swin_backbone``) puts :func:`load_from_swin_backbone` there for
local paths, ``http(s)://`` URLs and mmengine's named references (``torchvision://``,
``open-mmlab://``, ``mmcls://``). So ``load_from``, ``--resume`` (``Runner.resume``),
``mmengine.runner.load_checkpoint``, ``init_cfg=dict(type='Pretrained')`` of any module, mmdet's
``init_detector`` / mmseg's ``init_model`` and the inferencers' weights all read through the
inert unpickler (:mod:`.unpickler`), on every torch, and mmengine's own Runner checkpoints load on
torch >= 2.6 without widening torch's weights-only list. ``pavi://``, ``s3://`` / ``petrel://`` and
any scheme a user registers stay mmengine's (docs/checkpoints.md, "Security model").

One key is dropped: ``meta['config']``, the Python config text that mmcv 1.x and early mmengine
runs saved, which ``Runner.resume`` executes (``Config.fromstring``); a warning names it.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

#: The prefixes this package reads for mmengine ('' is mmengine's catch-all: local paths).
PREFIXES = ("", "http://", "https://", "torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")
#: ``meta`` keys that mmengine executes as Python when it resumes.
EXECUTED_META = ("config",)


def load_from_swin_backbone(filename: str, map_location: Any = None) -> Any:
    """mmengine's loader signature (``CheckpointLoader`` prints ``Loads checkpoint by
    swin_backbone backend``): what the file or reference holds, read as data only, without
    :data:`EXECUTED_META`."""
    from .loading import read_checkpoint

    path = filename if "://" in filename else os.path.expanduser(filename)
    checkpoint = read_checkpoint(path, map_location)
    drop_executed_meta(checkpoint, filename)
    return checkpoint


def drop_executed_meta(checkpoint: Any, source: str) -> None:
    """Remove :data:`EXECUTED_META` from ``checkpoint['meta']``, warning with its name."""
    meta = checkpoint.get("meta") if isinstance(checkpoint, dict) else None
    if not isinstance(meta, dict):
        return
    for key in EXECUTED_META:
        if key in meta:
            del meta[key]
            warnings.warn(f"checkpoint {source}: meta[{key!r}] dropped: a Python config text (saved by mmcv 1.x or an "
                          "early mmengine run) that mmengine's Runner.resume would execute; the rest of the checkpoint "
                          "loads as saved", UserWarning, stacklevel=3)


def register() -> None:
    """Make :func:`load_from_swin_backbone` mmengine's loader for :data:`PREFIXES`."""
    from mmengine.runner.checkpoint import CheckpointLoader

    CheckpointLoader.register_scheme(prefixes=list(PREFIXES), loader=load_from_swin_backbone, force=True)
