"""Swin V2 checkpoint formats: detection, conversion to ours and from ours.

A state dict is Swin V2 when it has continuous-position-bias MLPs or cosine-attention
scales (``cpb_mlp``, ``logit_scale``). Its layout is then told apart as for V1
(:func:`~swin_backbone.checkpoint.detect.detect_layout`) and named ``'<layout>-v2'``:

============== ===================================================================================
ours-v2         ``stages.{i}.blocks.{j}.attn.{qkv.weight, q_bias, v_bias, logit_scale, cpb_mlp}``,
                ``stages.{i}.downsample`` (end of stage i), ``norm{i}``.
official-v2     microsoft/Swin-Transformer ``swin_transformer_v2.py`` (under ``model``):
                ``layers.{i}``, downsample at the end of stage i, persistent
                ``relative_coords_table`` / ``relative_position_index`` / ``attn_mask`` buffers
                (dropped), final ``norm``, ``head``.
timm-v2         ``layers.{i}.downsample`` at the START of stage i (i >= 1), ``head.fc``.
torchvision-v2  ``features.{k}``; one fused ``qkv.bias`` (split into q and v; its k slice,
                which torchvision zeroes in every forward, is dropped: reported when non-zero),
                ``mlp.0`` / ``mlp.3``.
mmpretrain-v2   ``stages.{i}.downsample`` at the START of stage i (i >= 1), ``attn.w_msa``,
                ``ffn.layers``, ``patch_embed.projection``, ``norm3`` extra norms; the merge's
                reduction in nn.Unfold channel order (its LayerNorm is over ``2C``: no order).
============== ===================================================================================

V2 weights do not depend on the window (the position bias is an MLP of coordinates), so no
V2 tensor is ever resized.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Dict, Iterable, List

import torch

from .base import CheckpointError, Converted, StateDict, _drop_common, _final_norm_rule, _num_stages, _rename
from .base import register_format, rewrite_key, stage_depths, stage_tensor
from .formats import MMLAB_TO_OURS, OURS_TO_MMLAB, STAGES_TO_LAYERS, official_to_unfold, timm_to_ours
from .formats import torchvision_to_ours, unfold_to_official

V2_FORMATS = ("ours-v2", "official-v2", "mmpretrain-v2", "timm-v2", "torchvision-v2")

#: Key parts that only Swin V2 checkpoints have.
V2_MARKERS = re.compile(r"(^|\.)(cpb_mlp\.\d+\.weight|logit_scale)$")


def is_v2(keys: Iterable[str]) -> bool:
    """Whether an unwrapped state dict's keys are Swin V2's."""
    return any(V2_MARKERS.search(k) for k in keys)


def v2_format(layout: str) -> str:
    """V1 layout name (:func:`detect_layout`) -> V2 format name (``'mmdet'`` -> ``'mmpretrain-v2'``:
    mmpretrain is the OpenMMLab library with a V2)."""
    return ("mmpretrain" if layout == "mmdet" else layout) + "-v2"


# ---------------------------------------------------------------- to ours
def official_v2_to_ours(state: StateDict) -> Converted:
    n = _num_stages(state, r"^layers\.(\d+)\.")
    return _rename(state, [(r"^layers\.", "stages."), _final_norm_rule(n)], _drop_common)


def timm_v2_to_ours(state: StateDict) -> Converted:
    return timm_to_ours(state)


def torchvision_v2_to_ours(state: StateDict) -> Converted:
    """torchvision V2 -> ours; the fused ``qkv.bias`` is split into ``q_bias`` / ``v_bias``.

    torchvision zeroes the k slice of ``qkv.bias`` in every forward, so a non-zero k slice in a
    file changes nothing that torchvision computes: it is dropped the same way, and the report
    lists it under ``skipped`` (key ``'<key> [k slice]'``)."""
    k_slices: Dict[str, str] = {}
    for key, bias in state.items():
        if key.endswith(".attn.qkv.bias"):
            c = bias.shape[0] // 3
            k = bias[c : 2 * c]
            if bool(k.ne(0).any()):
                k_slices[f"{key} [k slice]"] = (
                    f"non-zero k bias (max |b| = {k.abs().max().item():.3g}) dropped: Swin V2 has no k bias and "
                    "torchvision zeroes this slice in every forward, so the loaded model computes what torchvision does"
                )
    out, notes, skipped = torchvision_to_ours(state)
    skipped.update(k_slices)
    for key in [k for k in out if k.endswith(".attn.qkv.bias")]:
        bias = out.pop(key)
        c = bias.shape[0] // 3
        base = key[: -len("qkv.bias")]
        out[base + "q_bias"], out[base + "v_bias"] = bias[:c], bias[2 * c :]
        notes[base + "q_bias"] = notes[base + "v_bias"] = "split from torchvision's fused qkv.bias (k slice dropped)"
    return out, notes, skipped


def mmpretrain_v2_to_ours(state: StateDict) -> Converted:
    # merging at the START of stage i; ours at the end of stage i - 1
    rules = [(r"^stages\.(\d+)\.downsample\.", lambda m: f"stages.{int(m.group(1)) - 1}.downsample.")] + MMLAB_TO_OURS
    out, notes, skipped = _rename(state, rules, _drop_common)  # type: ignore[arg-type]
    for key in list(out):
        if re.search(r"\.downsample\.reduction\.weight$", key):
            out[key] = unfold_to_official(out[key])
            notes[key] = "input channels reordered (nn.Unfold -> official order)"
    return out, notes, skipped


def ours_v2_to_ours(state: StateDict) -> Converted:
    return _rename(state, [], _drop_common)


# ---------------------------------------------------------------- from ours
def _output_norms(state: StateDict) -> List[int]:
    return sorted(int(m.group(1)) for m in map(re.compile(r"^norm(\d+)\.weight$").match, state) if m)


def _classification_norm(state: StateDict, key: str) -> str:
    """``norm{last}.*`` -> ``norm.*`` (the classification models' final norm); other output
    norms -> ``''`` (dropped: those models have none)."""
    m = re.match(r"^norm(\d+)\.(.*)$", key)
    if not m:
        return key
    norms = _output_norms(state)
    return f"norm.{m.group(2)}" if norms and int(m.group(1)) == norms[-1] else ""


def ours_v2_to_official(state: StateDict) -> StateDict:
    """Our V2 keys -> the official ``swin_transformer_v2.py`` keys (``layers.{i}``, final
    ``norm``; the buffers it saves are recomputed by it, so they are not written)."""
    out: StateDict = OrderedDict()
    for key, value in state.items():
        key = _classification_norm(state, key)
        if key:
            out[rewrite_key(key, STAGES_TO_LAYERS)] = value
    return out


def ours_v2_to_timm(state: StateDict) -> StateDict:
    """Our V2 keys -> timm ``SwinTransformerV2`` keys (merging at the start of stage i + 1)."""
    out: StateDict = OrderedDict()
    for key, value in state.items():
        key = _classification_norm(state, key)
        if not key:
            continue
        out[rewrite_key(key, _TO_TIMM)] = value
    return out


#: ours -> timm V2: merging at the start of stage i + 1, ``layers.{i}``.
_TO_TIMM = [(r"^stages\.(\d+)\.downsample\.", lambda m: f"layers.{int(m.group(1)) + 1}.downsample.")] + \
    STAGES_TO_LAYERS
#: ours -> torchvision: ``features.{k}`` interleaves the patch embedding, stages and mergings.
_TO_TORCHVISION = [
    (r"^patch_embed\.proj\.", "features.0.0."),
    (r"^patch_embed\.norm\.", "features.0.2."),
    (r"^stages\.(\d+)\.blocks\.", lambda m: f"features.{2 * int(m.group(1)) + 1}."),
    (r"^stages\.(\d+)\.downsample\.", lambda m: f"features.{2 * int(m.group(1)) + 2}."),
    (r"\.mlp\.fc1\.", ".mlp.0."),
    (r"\.mlp\.fc2\.", ".mlp.3."),
]
#: ours -> mmpretrain V2: merging at the start of stage i + 1, OpenMMLab's module names.
_TO_MMPRETRAIN = [(r"^stages\.(\d+)\.downsample\.", lambda m: f"stages.{int(m.group(1)) + 1}.downsample.")] + \
    OURS_TO_MMLAB


def ours_v2_to_torchvision(state: StateDict) -> StateDict:
    """Our V2 keys -> torchvision ``SwinTransformer`` (V2 blocks) keys: ``features.{k}``,
    the q / v biases fused into ``qkv.bias`` with a zero k slice."""
    out: StateDict = OrderedDict()
    for key, value in state.items():
        key = _classification_norm(state, key)
        if not key or key.endswith(".attn.v_bias"):
            continue
        if key.endswith(".attn.q_bias"):
            base = key[: -len("q_bias")]
            if base + "v_bias" not in state:  # a partial state dict: no half-made fused bias
                continue
            value = torch.cat((value, torch.zeros_like(value), state[base + "v_bias"]))
            key = base + "qkv.bias"
        out[rewrite_key(key, _TO_TORCHVISION)] = value
    return out


def ours_v2_to_mmpretrain(state: StateDict) -> StateDict:
    """Our V2 keys -> mmpretrain ``SwinTransformerV2`` keys (merging at the start of stage
    i + 1, its reduction in nn.Unfold order; output norms ``norm{i}`` kept)."""
    out: StateDict = OrderedDict()
    for key, value in state.items():
        if re.search(r"\.downsample\.reduction\.weight$", key):
            value = official_to_unfold(value)
        out[rewrite_key(key, _TO_MMPRETRAIN)] = value
    return out


# ---------------------------------------------------------------- registered
# in V2_FORMATS order; each layout's conversion to ours, and from ours where it is a target
register_format("ours-v2", ours_v2_to_ours, lambda s: OrderedDict(s))
register_format("official-v2", official_v2_to_ours, ours_v2_to_official)
register_format("mmpretrain-v2", mmpretrain_v2_to_ours, ours_v2_to_mmpretrain)
register_format("timm-v2", timm_v2_to_ours, ours_v2_to_timm)
register_format("torchvision-v2", torchvision_v2_to_ours, ours_v2_to_torchvision)


# ---------------------------------------------------------------- architecture from the tensors
def infer_v2_arch(raw: StateDict, state: StateDict, source: str = "checkpoint") -> Dict[str, object]:
    """:class:`~swin_backbone.SwinV2Backbone` keyword arguments that match a V2 checkpoint
    (``raw``: as found, ``state``: converted to ours), plus ``swin_version=2``.

    V2 weights do not depend on the window; it is read from a saved ``relative_coords_table``
    (official, torchvision, mmpretrain) where there is one, else 8 (any works for conversion).
    Raises :class:`CheckpointError` (naming ``source`` and the key) when a tensor the
    architecture is read from is missing.
    """
    proj = state.get("patch_embed.proj.weight")
    if proj is None:
        raise CheckpointError(f"{source}: no patch_embed.proj weight; cannot infer the architecture")
    depths = stage_depths(state, source)
    heads = [int(stage_tensor(state, i, "attn.logit_scale", source).shape[0]) for i in range(len(depths))]
    tables = [v for k, v in raw.items() if k.endswith("relative_coords_table")]
    window = (int(tables[0].shape[-2]) + 1) // 2 if tables else 8
    extra = sorted({int(m.group(1)) for m in (re.match(r"stages\.\d+\.blocks\.(\d+)\.norm3\.", k) for k in state) if m})
    return dict(
        swin_version=2,
        arch=None,
        embed_dims=int(proj.shape[0]),
        depths=tuple(depths),
        num_heads=tuple(heads),
        in_channels=int(proj.shape[1]),
        patch_size=int(proj.shape[-1]),
        window_size=window,
        qkv_bias=any(k.endswith(".attn.q_bias") for k in state),
        extra_norm_every_n_blocks=extra[0] + 1 if extra else 0,
        out_indices=tuple(i for i in range(len(depths)) if f"norm{i}.weight" in state) or (len(depths) - 1,),
        use_abs_pos_embed="absolute_pos_embed" in state,
    )
