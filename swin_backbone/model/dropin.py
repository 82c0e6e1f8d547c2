"""Drop-in use of mmdet / mmseg ``SwinTransformer`` backbone configs.

An mmdet 3.x or mmseg 1.x config switches to :class:`~swin_backbone.SwinBackbone` by changing
one word, ``type='SwinTransformer'`` -> ``type='SwinBackbone'``, keeping every other key of its
backbone. Most keys mean the same thing in both classes under the same name; the few forms
only the OpenMMLab classes have are translated here, by :func:`translate_mmlab_args`:

===================== =============================================================
``strides``           ``(patch_size, 2, 2, ...)``, one entry per stage: checked,
                      nothing else is possible (non-overlapping patches, 2x2 merging)
``act_cfg``           ``dict(type='GELU')``: checked
``norm_cfg``          ``dict(type='LN')`` (``requires_grad=True``, ``eps=1e-5`` allowed):
                      checked
``pretrained``        a checkpoint path: deprecated, becomes
                      ``init_cfg=dict(type='Pretrained', checkpoint=path)``
``pretrain_img_size`` ``S``, ``(S,)`` or ``(H, W)``: becomes ``(H, W)``
``patch_size``        ``P`` or ``(P, P)``: becomes ``P``
===================== =============================================================

A value the backbone cannot honour (another activation or norm, overlapping patches, a
merging stride other than 2) is a ``ValueError`` naming the argument, never a silently
different model.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from torch import nn

from ..validation import fail

#: An mmengine ``init_cfg``: one dict or a list of them.
InitCfg = Union[Mapping[str, Any], List[Mapping[str, Any]]]

#: The message mmdet 3.x and mmseg 1.x give for ``pretrained=`` (same text, same category,
#: so warning filters written for them keep working).
PRETRAINED_DEPRECATION = 'DeprecationWarning: pretrained is deprecated, please use "init_cfg" instead'

#: Extra keys of ``norm_cfg`` / ``act_cfg`` that mmcv accepts and that leave the layer as ours.
_LN_EXTRAS = {"requires_grad": True, "eps": 1e-5}
_GELU_EXTRAS = {"approximate": "none"}


@dataclass(frozen=True)
class MMLabArgs:
    """The mmdet / mmseg argument forms in the form :class:`SwinBackbone` uses.

    Attributes:
        patch_size: the patch-embedding stride (= kernel), an int.
        pretrain_img_size: ``(H, W)``.
        init_cfg: the mmengine init config, ``Pretrained`` where ``pretrained`` was given.

    Values are only translated here; whether they are valid ints is checked afterwards by
    :func:`~swin_backbone.validation.check_config` with the other arguments.
    """

    patch_size: int
    pretrain_img_size: Tuple[int, int]
    init_cfg: Optional[InitCfg]


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _square(name: str, value: Any) -> Any:
    """``P``, ``(P,)`` or ``(P, P)`` -> ``P``; anything else that is a sequence is an error.

    Non-sequences are returned unchanged (``check_config`` validates them as ints).
    """
    if not _is_sequence(value):
        return value
    if len(value) in (1, 2) and all(v == value[0] for v in value):
        return value[0]
    fail(name, "an int or a square (P, P) pair", value)


def _check_layer_cfg(
    name: str,
    cfg: Optional[Mapping[str, Any]],
    types: Tuple[Union[str, type], ...],
    extras: Mapping[str, Any],
    expected: str,
) -> None:
    """``cfg`` must build (with mmcv) exactly the layer this backbone hard-codes.

    ``type`` may be mmcv's registry name (``'LN'``, ``'GELU'``) or the class itself, the two
    forms mmcv's ``build_norm_layer`` / ``build_activation_layer`` accept.
    """
    if cfg is None:
        return
    if not isinstance(cfg, Mapping):
        fail(name, expected, cfg)
    same_options = all(key in extras and cfg[key] == extras[key] for key in cfg if key != "type")
    if not (cfg.get("type") in types and same_options):
        fail(name, expected, dict(cfg))


def translate_mmlab_args(
    *,
    num_stages: int,
    patch_size: Union[int, Sequence[int]],
    strides: Optional[Sequence[Union[int, Sequence[int]]]],
    pretrain_img_size: Union[int, Sequence[int]],
    act_cfg: Optional[Mapping[str, Any]],
    norm_cfg: Optional[Mapping[str, Any]],
    pretrained: Optional[str],
    init_cfg: Optional[InitCfg],
) -> MMLabArgs:
    """Check and translate the arguments of mmdet 3.x / mmseg 1.x ``SwinTransformer``.

    Args:
        num_stages: number of stages (``len(depths)``).
        patch_size: ``P`` or ``(P, P)``.
        strides: ``None`` (= consistent with ``patch_size``) or one stride per stage, as in
            mmdet: ``strides[0]`` is the patch-embedding stride and must equal ``patch_size``;
            ``strides[1:]`` are the patch-merging strides and must be 2.
        pretrain_img_size: ``S``, ``(S,)`` or ``(H, W)``.
        act_cfg: ``None`` or ``dict(type='GELU')`` (the only activation of this backbone).
        norm_cfg: ``None`` or ``dict(type='LN')``, optionally with ``requires_grad=True`` and
            ``eps=1e-5`` (mmcv's defaults); the only norm of this backbone.
        pretrained: deprecated checkpoint path; becomes
            ``init_cfg=dict(type='Pretrained', checkpoint=pretrained)`` with the deprecation
            warning mmdet and mmseg give.
        init_cfg: the mmengine init config; cannot be combined with ``pretrained``.

    Returns:
        The arguments in the forms :class:`~swin_backbone.SwinBackbone` uses.

    Raises:
        ValueError: ``"<argument>: expected <what>, got <value>"`` for a value that this
            backbone cannot honour.
    """
    patch_size = _square("patch_size", patch_size)

    if strides is not None and num_stages >= 1:  # num_stages < 1: check_config reports depths
        expected = f"{num_stages} entries (patch stride = patch_size, then {num_stages - 1} merging strides of 2)"
        if not _is_sequence(strides) or len(strides) != num_stages:
            fail("strides", expected, strides)
        steps = [_square(f"strides[{i}]", s) for i, s in enumerate(strides)]
        if steps[0] != patch_size:
            fail("strides", f"strides[0] == patch_size ({patch_size!r}): non-overlapping patches", strides)
        if any(s != 2 for s in steps[1:]):
            fail("strides", "merging strides strides[1:] of 2 (2x2 patch merging)", strides)

    if _is_sequence(pretrain_img_size):
        if len(pretrain_img_size) not in (1, 2):
            fail("pretrain_img_size", "an int, (S,) or (H, W)", pretrain_img_size)
        pretrain_img_size = (pretrain_img_size[0], pretrain_img_size[-1])  # (S,) -> (S, S)
    elif isinstance(pretrain_img_size, int) and not isinstance(pretrain_img_size, bool):
        pretrain_img_size = (pretrain_img_size, pretrain_img_size)

    _check_layer_cfg("act_cfg", act_cfg, ("GELU", nn.GELU), _GELU_EXTRAS, "dict(type='GELU')")
    _check_layer_cfg(
        "norm_cfg",
        norm_cfg,
        ("LN", nn.LayerNorm),
        _LN_EXTRAS,
        "dict(type='LN') (LayerNorm; requires_grad=True and eps=1e-5 allowed)",
    )

    if pretrained is not None:
        if not isinstance(pretrained, str) or not pretrained:
            fail("pretrained", "a checkpoint path (str) or None", pretrained)
        if init_cfg:
            fail("pretrained", "None when init_cfg is given (they cannot be specified at the same time)", pretrained)
        warnings.warn(PRETRAINED_DEPRECATION, stacklevel=3)
        init_cfg = dict(type="Pretrained", checkpoint=pretrained)

    return MMLabArgs(patch_size=patch_size, pretrain_img_size=pretrain_img_size, init_cfg=init_cfg)
