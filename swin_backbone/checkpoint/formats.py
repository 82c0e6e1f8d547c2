"""Swin checkpoint formats: key conversion to and from ours (Swin V1 layouts).

Formats (after unwrapping ``state_dict`` / ``model`` / ``module.`` / ``backbone.``):

========== ===================================================================================
ours        ``stages.{i}.blocks.{j}.attn.qkv``, ``stages.{i}.downsample`` (end of stage i),
            ``patch_embed.proj``, ``norm{i}``; official PatchMerging channel order.
official    microsoft/Swin-Transformer (classification: final ``norm``, ``head``) and the
            official detection / segmentation repos (``norm{i}``): ``layers.{i}``,
            downsample at the end of stage i, official channel order.
mmdet       mmdet 3.x / mmseg 1.x / mmpretrain: ``stages.{i}...attn.w_msa``, ``ffn.layers``,
            ``patch_embed.projection``; nn.Unfold channel order in ``downsample``.
timm        ``layers.{i}.downsample`` at the START of stage i (i >= 1), ``head.fc``.
torchvision ``features.{k}``: patch embedding, stages and mergings interleaved.
hf          Hugging Face transformers ``SwinModel`` / ``SwinBackbone`` / ``Swin*For*`` under any
            root prefix (:mod:`.formats_hf`).
========== ===================================================================================

This module registers the V1 layouts (:func:`~.base.register_format`); Swin V2's are in
:mod:`.formats_v2`, and :mod:`.detect` tells the formats apart.

mmcls 0.x / mmpretrain files of state-dict version < 2 store the last stage's norm as ``norm.*``
(mmpretrain renames it on load): read as ``norm{last}``, as for the classification layouts.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Dict, List

import torch

from .base import CheckpointError, Converted, Rule, StateDict, _drop_common, _final_norm_rule, _num_stages, _rename
from .base import register_format, rewrite_key, stage_depths, stage_tensor
from .resize import table_window

V1_FORMATS = ("ours", "official", "mmdet", "timm", "torchvision")


# ---------------------------------------------------------------- channel order of PatchMerging
# Official order: k = 2 * dw + dh; nn.Unfold (mmdet) order: c * 4 + (2 * dh + dw).
_UNFOLD_PERM = [0, 2, 1, 3]  # official block k <-> unfold block k' (self-inverse)
_MERGE_CHANNELS = re.compile(r"\.downsample\.(reduction\.weight|norm\.weight|norm\.bias)$")


def unfold_to_official(t: torch.Tensor) -> torch.Tensor:
    """PatchMerging ``reduction.weight (out, 4C)`` or ``norm.* (4C,)``: mmdet -> official."""
    lead = t.shape[:-1]
    c = t.shape[-1] // 4
    return t.reshape(*lead, c, 4)[..., _UNFOLD_PERM].transpose(-1, -2).reshape(*lead, 4 * c)


def official_to_unfold(t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unfold_to_official`."""
    lead = t.shape[:-1]
    c = t.shape[-1] // 4
    return t.reshape(*lead, 4, c)[..., _UNFOLD_PERM, :].transpose(-1, -2).reshape(*lead, 4 * c)


# ---------------------------------------------------------------- conversion to ours
def official_to_ours(state: StateDict) -> Converted:
    n = _num_stages(state, r"^layers\.(\d+)\.")
    return _rename(state, [(r"^layers\.", "stages."), _final_norm_rule(n)], _drop_common)


def timm_to_ours(state: StateDict) -> Converted:
    n = _num_stages(state, r"^layers\.(\d+)\.")
    rules = [
        # timm merges at the START of stage i; ours (and official) at the end of stage i - 1.
        (r"^layers\.(\d+)\.downsample\.", lambda m: f"stages.{int(m.group(1)) - 1}.downsample."),
        (r"^layers\.", "stages."),
        _final_norm_rule(n),
    ]
    return _rename(state, rules, _drop_common)  # type: ignore[arg-type]


def torchvision_to_ours(state: StateDict) -> Converted:
    n = (_num_stages(state, r"^features\.(\d+)\.") + 1) // 2 if state else 0

    def feature(m: re.Match) -> str:
        k = int(m.group(1))
        if k == 0:
            return "patch_embed.proj." if m.group(2) == "0" else "patch_embed.norm."
        if k % 2 == 1:
            return f"stages.{(k - 1) // 2}.blocks.{m.group(2)}."
        return f"stages.{k // 2 - 1}.downsample.{m.group(2)}."

    rules = [
        (r"^features\.(\d+)\.(\w+)\.", feature),
        (r"\.mlp\.0\.", ".mlp.fc1."),
        (r"\.mlp\.3\.", ".mlp.fc2."),
        _final_norm_rule(n),
    ]
    return _rename(state, rules, _drop_common)  # type: ignore[arg-type]


#: OpenMMLab's module names (mmdet / mmseg / mmpretrain, V1 and V2) -> ours, and back.
MMLAB_TO_OURS: List[Rule] = [
    (r"^patch_embed\.projection\.", "patch_embed.proj."),
    (r"\.attn\.w_msa\.", ".attn."),
    (r"\.ffn\.layers\.0\.0\.", ".mlp.fc1."),
    (r"\.ffn\.layers\.1\.", ".mlp.fc2."),
]
OURS_TO_MMLAB: List[Rule] = [
    (r"^patch_embed\.proj\.", "patch_embed.projection."),
    (r"\.attn\.(qkv|proj|relative_position_bias_table|q_bias|v_bias|logit_scale|cpb_mlp)", r".attn.w_msa.\1"),
    (r"\.mlp\.fc1\.", ".ffn.layers.0.0."),
    (r"\.mlp\.fc2\.", ".ffn.layers.1."),
]
#: Our ``stages.{i}`` -> the official / timm ``layers.{i}``.
STAGES_TO_LAYERS: List[Rule] = [(r"^stages\.", "layers.")]


def mmdet_to_ours(state: StateDict) -> Converted:
    n = _num_stages(state, r"^stages\.(\d+)\.")
    rules = MMLAB_TO_OURS + [_final_norm_rule(n)]  # (norm: mmcls 0.x / mmpretrain state-dict version < 2)
    out, notes, skipped = _rename(state, rules, _drop_common)
    for key in [k for k in notes if notes[k].startswith("renamed from norm.")]:
        notes[key] += " (mmcls / mmpretrain state-dict version < 2: the last stage's norm)"
    for key in list(out):
        if _MERGE_CHANNELS.search(key):
            out[key] = unfold_to_official(out[key])
            notes[key] = "channels reordered (nn.Unfold -> official order)"
    return out, notes, skipped


def ours_to_ours(state: StateDict) -> Converted:
    return _rename(state, [], _drop_common)


# ---------------------------------------------------------------- conversion from ours
def ours_to_official(state: StateDict) -> StateDict:
    """Our keys -> the official detection layout (``layers.{i}``, ``norm{i}``).

    Absolute position embeddings stay ``(1, C, Gh, Gw)`` as in the official detection repo.
    """
    return OrderedDict((rewrite_key(k, STAGES_TO_LAYERS), v) for k, v in state.items())


def ours_to_mmdet(state: StateDict) -> StateDict:
    """Our keys -> mmdet 3.x / mmseg 1.x ``SwinTransformer`` keys (nn.Unfold order).

    The absolute position embedding becomes mmdet's ``(1, Gh * Gw, C)``.
    """
    out: StateDict = OrderedDict()
    for key, value in state.items():
        new = rewrite_key(key, OURS_TO_MMLAB)
        if _MERGE_CHANNELS.search(key):
            value = official_to_unfold(value)
        if key == "absolute_pos_embed" and value.dim() == 4:
            value = value.flatten(2).transpose(1, 2)
        out[new] = value
    return out


# ---------------------------------------------------------------- registered
register_format("ours", ours_to_ours, lambda s: OrderedDict(s))
register_format("official", official_to_ours, ours_to_official)
register_format("mmdet", mmdet_to_ours, ours_to_mmdet)
register_format("timm", timm_to_ours)
register_format("torchvision", torchvision_to_ours)


# ---------------------------------------------------------------- architecture from the tensors
def infer_v1_arch(state: StateDict, source: str = "checkpoint") -> Dict[str, object]:
    """:class:`~swin_backbone.SwinBackbone` keyword arguments that match a V1 checkpoint
    (``state``: converted to ours): embed_dims, depths, heads, window, patch size, input
    channels, absolute position embedding and output norms, from the tensors' shapes. Raises
    :class:`CheckpointError` (naming ``source`` and the key) when a tensor they are read from
    is missing (Swin V2: :func:`.formats_v2.infer_v2_arch`)."""
    proj = state.get("patch_embed.proj.weight")
    if proj is None:
        raise CheckpointError(f"{source}: no patch_embed.proj weight; cannot infer the architecture")
    depths = stage_depths(state, source)
    tables = [stage_tensor(state, i, "attn.relative_position_bias_table", source) for i in range(len(depths))]
    kwargs = dict(
        arch=None,
        embed_dims=int(proj.shape[0]),
        depths=tuple(depths),
        num_heads=tuple(int(t.shape[1]) for t in tables),
        in_channels=int(proj.shape[1]),
        patch_size=int(proj.shape[-1]),
        window_size=table_window(tables[0].shape[0])[0] if tables else 7,
        qkv_bias=any(k.endswith(".attn.qkv.bias") for k in state),
        out_indices=tuple(i for i in range(len(depths)) if f"norm{i}.weight" in state) or (len(depths) - 1,),
        use_abs_pos_embed="absolute_pos_embed" in state,
    )
    if kwargs["use_abs_pos_embed"]:
        pos = state["absolute_pos_embed"]
        grid = pos.shape[-2:] if pos.dim() == 4 else (int(pos.shape[1] ** 0.5),) * 2
        kwargs["pretrain_img_size"] = (int(grid[0]) * kwargs["patch_size"], int(grid[1]) * kwargs["patch_size"])
    return kwargs
