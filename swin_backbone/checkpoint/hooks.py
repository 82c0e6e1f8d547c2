"""What the checkpoint package plugs into every backbone (it sits above the model, which
therefore imports nothing of it): the ``Pretrained`` initializer and a state-dict pre-hook.

``init_cfg=dict(type='Pretrained', checkpoint=PATH)`` runs :class:`SwinPretrainedInit`
(registered in mmengine's ``WEIGHT_INITIALIZERS``): any supported format, a per-key report;
``PATH`` may be a URL or another reference mmengine takes (:mod:`.remote`); mmengine's ``prefix=``
takes the keys under it (``'teacher.backbone.'``). The layouts mmdet /
mmseg read themselves load as they do (a classifier's final norm is not the last stage's
output norm), so a config switched to SwinBackbone starts from the library's weights.

The pre-hook converts checkpoint keys as they arrive in ``load_state_dict``.

With it, loading a *whole* detector or segmentor checkpoint (``load_from=``, ``--resume``,
``mmengine.runner.load_checkpoint``) into a model whose backbone is SwinBackbone works for
every supported format: e.g. a model-zoo mmdet Mask R-CNN Swin-T checkpoint loads into our
config unchanged, its backbone keys converted and its PatchMerging channels reordered.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from mmengine.logging import print_log
from mmengine.registry import WEIGHT_INITIALIZERS
from torch import nn

from ..model.backbone import LOAD_STATE_DICT_PRE_HOOKS, PRETRAINED_INIT
from .base import prefixed
from .detect import detect_format
from .loading import load_checkpoint, prepare_state_dict


@WEIGHT_INITIALIZERS.register_module(name=PRETRAINED_INIT)
class SwinPretrainedInit:
    """Load a Swin checkpoint file of any supported format into a backbone, with a per-key
    report (:func:`~swin_backbone.checkpoint.load_checkpoint`).

    Takes mmengine's ``PretrainedInit`` arguments: ``prefix`` (e.g. ``'backbone.'`` of a whole
    detector, ``'teacher.backbone.'`` of a distillation checkpoint) loads the keys under it; a
    prefix no key has is an error.
    """

    def __init__(self, checkpoint: str, prefix: Optional[str] = None, map_location: str = "cpu", **_: Any) -> None:
        self.checkpoint, self.prefix, self.map_location = checkpoint, prefix, map_location

    def __call__(self, module: nn.Module) -> None:
        # As mmdet's / mmseg's own initialisation: a classifier's final norm is not the last
        # stage's output norm there (their SwinTransformer never loads it).
        load_checkpoint(module, self.checkpoint, map_location=self.map_location, final_norm=False, prefix=self.prefix)


def _convert_on_load(
    module: nn.Module,
    state_dict: Dict[str, Any],
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: List[str],
    unexpected_keys: List[str],
    error_msgs: List[str],
) -> None:
    sub = prefixed(state_dict, prefix)
    if not sub or detect_format(sub) == "unknown":
        return  # nothing of ours here; torch reports missing keys as usual
    state, report = prepare_state_dict(sub, module, source=f"'{prefix or '<root>'}*'")
    if report.format in ("ours", "ours-v2") and not report.resized and not report.skipped:
        return
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]
    # Everything goes back converted, unexpected and mismatched tensors included, so torch
    # reports those as usual (and fails on them under strict loading).
    state_dict.update({prefix + k: v for k, v in state.items()})
    print_log(
        f"SwinBackbone: converted checkpoint keys under '{prefix}' from format '{report.format}' "
        f"({len(report.converted)} renamed/reordered, {len(report.resized)} resized, "
        f"{len(report.skipped)} skipped)",
        logger="current",
        level=logging.INFO,
    )


# Every backbone built from now on converts keys as they arrive.
LOAD_STATE_DICT_PRE_HOOKS.append(_convert_on_load)
