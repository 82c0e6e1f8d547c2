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

mmengine executes texts a checkpoint may hold as Python (``Config.fromstring``), and builds the
objects a config names, importing any dotted name it does not know (``Registry.get``): so no such
text reaches it. ``meta['config']`` (mmcv 1.x and early mmengine runs; ``Runner.resume`` and
``FlexibleRunner.resume`` run it) is dropped with a warning; ``meta['cfg']`` and
``message_hub['runtime_info']['cfg']`` (the run's config, which mmengine's Runner writes and the
inferencers given weights without a model config build from) are left out with a log line.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

#: The prefixes this package reads for mmengine ('' is mmengine's catch-all: local paths).
PREFIXES = ("", "http://", "https://", "torchvision://", "modelzoo://", "open-mmlab://", "openmmlab://", "mmcls://")
#: Where a checkpoint holds Python text that mmengine executes: (name, path of keys).
EXECUTED_TEXTS = (("meta['config']", ("meta", "config")), ("meta['cfg']", ("meta", "cfg")),
                  ("message_hub['runtime_info']['cfg']", ("message_hub", "runtime_info", "cfg")))


def load_from_swin_backbone(filename: str, map_location: Any = None) -> Any:
    """mmengine's loader signature (``CheckpointLoader`` prints ``Loads checkpoint by
    swin_backbone backend``): what the file or reference holds, read as data only, without
    the Python texts mmengine would execute (:func:`drop_executed_texts`)."""
    from .loading import read_checkpoint

    path = filename if "://" in filename else os.path.expanduser(filename)
    checkpoint = read_checkpoint(path, map_location)
    drop_executed_texts(checkpoint, filename)
    return checkpoint


def drop_executed_texts(checkpoint: Any, source: str) -> None:
    """Remove :data:`EXECUTED_TEXTS` from ``checkpoint`` (in place): ``meta['config']`` with a
    warning (an old run's; a resume would execute it), the run's config (``cfg``) with a log line."""
    if not isinstance(checkpoint, dict):
        return
    for name, keys in EXECUTED_TEXTS:
        table = checkpoint
        for key in keys[:-1]:
            table = table.get(key) if isinstance(table, dict) else None
        if not isinstance(table, dict) or keys[-1] not in table:
            continue
        del table[keys[-1]]
        if keys[-1] == "config":
            warnings.warn(f"checkpoint {source}: {name} dropped: a Python config text (saved by mmcv 1.x or an early "
                          "mmengine run) that mmengine's resume would execute; the rest of the checkpoint loads as "
                          "saved", UserWarning, stacklevel=3)
        else:
            from mmengine.logging import print_log

            print_log(f"checkpoint {source}: {name} left out: the run's config text, which mmengine's inferencers "
                      "execute (and build the objects it names) when given weights without a model config; pass "
                      "the config: DetInferencer(model='config.py', weights=...) (docs/checkpoints.md)",
                      logger="current", level=logging.INFO)


def register() -> None:
    """Make :func:`load_from_swin_backbone` mmengine's loader for :data:`PREFIXES`."""
    from mmengine.runner.checkpoint import CheckpointLoader

    CheckpointLoader.register_scheme(prefixes=list(PREFIXES), loader=load_from_swin_backbone, force=True)
