"""Hugging Face ``transformers`` Swin and Swin V2 checkpoints: detection, conversion to ours and
from ours (format ``'hf'``; ``'hf-v2'`` for Swin V2).

A transformers Swin model sits under a *root* prefix: ``''`` (``SwinModel``, ``Swinv2Model``,
``Swinv2Backbone`` saved alone), ``swin.`` / ``swinv2.`` (``*ForImageClassification``,
``*ForMaskedImageModeling``, transformers 5's ``SwinBackbone``) or any other (``model.``,
``backbone.`` of UperNet, ...). Under the root, per stage ``i`` and block ``j``:

=================================================================== =========================================
transformers (hub files, transformers 4; V2 in memory too)          ours
=================================================================== =========================================
``embeddings.patch_embeddings.projection`` / ``embeddings.norm``    ``patch_embed.proj`` / ``patch_embed.norm``
``embeddings.position_embeddings`` ``(1, L, C)``                    ``absolute_pos_embed``
``encoder.layers.{i}.blocks.{j}.layernorm_before`` / ``_after``     ``stages.{i}.blocks.{j}.norm1`` / ``norm2``
``...attention.self.query`` / ``key`` / ``value``                   ``...attn.qkv`` (fused; V2: ``q_bias`` /
                                                                    ``v_bias``, the key has no bias)
``...attention.self.relative_position_bias_table`` (V1)             ``...attn.relative_position_bias_table``
``...attention.self.logit_scale`` / ``continuous_position_bias_mlp`` ``...attn.logit_scale`` / ``attn.cpb_mlp``
``...attention.output.dense``                                       ``...attn.proj``
``...intermediate.dense`` / ``...output.dense``                     ``...mlp.fc1`` / ``mlp.fc2``
``encoder.layers.{i}.downsample`` (end of stage ``i``)              ``stages.{i}.downsample`` (same channel
                                                                    order: x0, x1, x2, x3 as the official)
``layernorm`` (the model's final norm)                              ``norm{last}``
``hidden_states_norms.stage{i+1}`` (``SwinBackbone``, beside root)  ``norm{i}``
=================================================================== =========================================

transformers 5 renames V1's keys in memory, so state dicts saved from a live V1 model carry
``attention.q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, ``mlp.fc1`` / ``fc2`` and
``attention.relative_position_bias.relative_position_bias_table``: both generations load.
Keys outside the root (``classifier``, ``decoder``, detection / segmentation heads) and the
masked-image-modeling ``mask_token`` are skipped, each with its reason in the report.

Written (``--to hf``): transformers 4's names (what every transformers version loads) under
``swin.`` / ``swinv2.``, output norms as ``hidden_states_norms.stage{i+1}`` (V1) and the last
stage's norm also as the final ``layernorm``.
"""
from __future__ import annotations

import re
from collections import Counter, OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .base import CheckpointError, Converted, StateDict, _drop_common, register_format
from .formats_v2 import is_v2

HF_FORMATS = ("hf", "hf-v2")

#: A transformers Swin block key; group 1 is the root prefix.
_HF_BLOCK = re.compile(
    r"^((?:[\w-]+\.)*?)encoder\.layers\.\d+\.blocks\.\d+\."
    r"(?:layernorm_before|layernorm_after|attention|intermediate|output|mlp)\."
)
_HIDDEN_NORM = re.compile(r"^((?:[\w-]+\.)*?)hidden_states_norms\.(stem|stage(\d+))\.(.+)$")

#: Key renames under the root, in order (both key generations; V1 and V2).
_RULES: List[Tuple[str, str]] = [
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^embeddings\.norm\.", "patch_embed.norm."),
    (r"^embeddings\.position_embeddings$", "absolute_pos_embed"),
    (r"^encoder\.layers\.(\d+)\.", r"stages.\1."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.attention\.self\.query\.", ".attn.q."),
    (r"\.attention\.self\.key\.", ".attn.k."),
    (r"\.attention\.self\.value\.", ".attn.v."),
    (r"\.attention\.([qkv])_proj\.", r".attn.\1."),
    (r"\.attention\.(?:self|relative_position_bias)\.relative_position_bias_table$",
     ".attn.relative_position_bias_table"),
    (r"\.attention\.self\.logit_scale$", ".attn.logit_scale"),
    (r"\.attention\.self\.continuous_position_bias_mlp\.", ".attn.cpb_mlp."),
    (r"\.attention\.output\.dense\.", ".attn.proj."),
    (r"\.attention\.o_proj\.", ".attn.proj."),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
]


def hf_root(keys: Iterable[str]) -> Optional[str]:
    """Root prefix of the transformers Swin model in a state dict (``''``, ``'swin.'``,
    ``'model.swin.'`` ...), or ``None`` when the keys are not transformers Swin keys.
    With several Swin models in one file, the one with the most block keys."""
    roots = Counter(m.group(1) for m in map(_HF_BLOCK.match, keys) if m)
    if not roots:
        return None
    return min(roots, key=lambda r: (-roots[r], len(r)))


def _outside_reason(key: str, root: str = "") -> str:
    """Why a key outside the transformers Swin model (at ``root``) is skipped: named from its
    first component beside the model (``classifier``, ``decoder``, ...)."""
    parent = root[: root[:-1].rfind(".") + 1] if root else ""
    last = (key[len(parent):] if key.startswith(parent) else key).split(".")[0]
    if last == "classifier":
        return "classification head (transformers)"
    if last == "decoder":
        return "masked-image-modeling decoder (transformers)"
    return "outside the transformers Swin model (a head or another module of the checkpoint)"


def _num_hf_stages(state: Iterable[str], root: str) -> int:
    pattern = re.compile(rf"^{re.escape(root)}encoder\.layers\.(\d+)\.")
    found = [int(m.group(1)) for m in map(pattern.match, state) if m]
    return max(found) + 1 if found else 0


def hf_to_ours(state: StateDict) -> Converted:
    """transformers Swin / Swin V2 keys (either generation, any root) -> ours.

    Returns ``(state, converted: new key -> how, skipped: old key -> why)``.
    """
    root = hf_root(state) or ""
    v2 = is_v2(state)
    n = _num_hf_stages(state, root)
    stage_norms = {int(m.group(3)) for m in map(_HIDDEN_NORM.match, state) if m and m.group(3)}
    out: StateDict = OrderedDict()
    notes: Dict[str, str] = {}
    skipped: Dict[str, str] = {}
    for key, value in state.items():
        new, reason = _convert_key(key, root, n, stage_norms)
        if reason:
            skipped[key] = reason
            continue
        out[new] = value
        notes[new] = f"renamed from {key}"
    _fuse_qkv(out, notes, v2)
    return out, notes, skipped


def _convert_key(key: str, root: str, n: int, stage_norms: set) -> Tuple[str, str]:
    """``(our key, '')`` or ``('', reason to skip)`` for one transformers key."""
    norm = _HIDDEN_NORM.match(key)
    if norm and root.startswith(norm.group(1)):
        if norm.group(2) == "stem":
            return "", "output norm of transformers' 'stem' feature (SwinBackbone has no stem output)"
        return f"norm{int(norm.group(3)) - 1}.{norm.group(4)}", ""
    if re.search(r"(^|\.)layernorm\.(weight|bias)$", key) and n in stage_norms:
        return "", (f"the transformers model's final norm, unused by its SwinBackbone "
                    f"(hidden_states_norms.stage{n} is the last output norm)")
    if not key.startswith(root):
        return "", _outside_reason(key, root)
    rest = key[len(root):]
    reason = _drop_common(rest)
    if reason:
        return "", reason
    if rest == "embeddings.mask_token":
        return "", "masked-image-modeling mask token (transformers)"
    if rest.startswith("layernorm."):
        return f"norm{n - 1}.{rest[len('layernorm.'):]}", ""
    new = rest
    for pattern, repl in _RULES:
        new = re.sub(pattern, repl, new)
    if new == rest and not rest.startswith(("patch_embed.", "stages.")):
        return "", _outside_reason(rest)
    return new, ""


_QKV_PART = re.compile(r"^(.*\.attn\.)q\.(weight|bias)$")


def _fuse_qkv(out: StateDict, notes: Dict[str, str], v2: bool) -> None:
    """transformers' separate q / k / v projections -> our fused ``qkv`` (in place); V2's q and
    v biases become ``q_bias`` / ``v_bias`` (its key projection has no bias). A block with a
    part missing keeps its parts unfused: they show as unexpected, ``qkv`` as missing."""
    for q_key in [k for k in out if _QKV_PART.match(k)]:
        base, param = _QKV_PART.match(q_key).groups()  # type: ignore[union-attr]
        parts = [f"{base}{p}.{param}" for p in "qkv"]
        sources = ", ".join(notes[p][len("renamed from "):] for p in parts if p in notes)
        if v2 and param == "bias":
            for p, ours in (("q", "q_bias"), ("v", "v_bias")):
                if f"{base}{p}.bias" in out:
                    out[base + ours] = out.pop(f"{base}{p}.bias")
                    notes[base + ours] = f"renamed from {notes.pop(f'{base}{p}.bias')[len('renamed from '):]}"
            continue
        if not all(p in out for p in parts):
            continue
        out[f"{base}qkv.{param}"] = torch.cat([out.pop(p) for p in parts])
        for p in parts:
            notes.pop(p, None)
        notes[f"{base}qkv.{param}"] = f"fused from transformers' query / key / value ({sources})"


# ---------------------------------------------------------------- from ours
_BACK: List[Tuple[str, str]] = [
    (r"^patch_embed\.proj\.", "embeddings.patch_embeddings.projection."),
    (r"^patch_embed\.norm\.", "embeddings.norm."),
    (r"^stages\.(\d+)\.", r"encoder.layers.\1."),
    (r"\.norm1\.", ".layernorm_before."),
    (r"\.norm2\.", ".layernorm_after."),
    (r"\.attn\.relative_position_bias_table$", ".attention.self.relative_position_bias_table"),
    (r"\.attn\.logit_scale$", ".attention.self.logit_scale"),
    (r"\.attn\.cpb_mlp\.", ".attention.self.continuous_position_bias_mlp."),
    (r"\.attn\.proj\.", ".attention.output.dense."),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
]


def _back(key: str) -> str:
    for pattern, repl in _BACK:
        key = re.sub(pattern, repl, key)
    return key


def _ours_to_hf(state: StateDict, v2: bool) -> StateDict:
    root = "swinv2." if v2 else "swin."
    stages = [int(m.group(1)) for m in map(re.compile(r"^stages\.(\d+)\.").match, state) if m]
    last = max(stages) if stages else -1
    out: StateDict = OrderedDict()
    for key, value in state.items():
        norm = re.match(r"^norm(\d+)\.(.*)$", key)
        qkv = re.match(r"^(.*\.attn\.)qkv\.(weight|bias)$", key)
        bias = re.match(r"^(.*\.attn\.)([qv])_bias$", key)
        if norm:
            i, param = int(norm.group(1)), norm.group(2)
            if not v2:  # transformers' SwinBackbone output norms
                out[f"hidden_states_norms.stage{i + 1}.{param}"] = value
            if i == last:  # the model's final norm is the last stage's output norm
                out[f"{root}layernorm.{param}"] = value
        elif qkv:
            base = root + _back(qkv.group(1)).replace(".attn.", ".attention.self.")
            for name, part in zip(("query", "key", "value"), value.chunk(3)):
                out[f"{base}{name}.{qkv.group(2)}"] = part
        elif bias:
            base = root + _back(bias.group(1)).replace(".attn.", ".attention.self.")
            out[f"{base}{'query' if bias.group(2) == 'q' else 'value'}.bias"] = value
        elif key == "absolute_pos_embed":
            if v2:
                raise CheckpointError(
                    "to hf: transformers' Swinv2 has no usable absolute position embedding "
                    "(its (1, L + 1, C) parameter does not match its tokens); this V2 model cannot be written as hf"
                )
            tokens = value.flatten(2).transpose(1, 2) if value.dim() == 4 else value
            out[f"{root}embeddings.position_embeddings"] = tokens
        elif v2 and re.search(r"\.norm3\.", key):
            raise CheckpointError(
                f"to hf: '{key}' is an extra block norm (Swin V2 huge / giant); transformers' Swinv2 has none, "
                "so this model cannot be written as hf"
            )
        else:
            out[root + _back(key)] = value
    return out


def ours_to_hf(state: StateDict) -> StateDict:
    """Our V1 keys -> transformers ``Swin*`` keys (transformers 4's names under ``swin.``;
    output norms as ``SwinBackbone``'s ``hidden_states_norms``, the last also as ``layernorm``)."""
    return _ours_to_hf(state, v2=False)


def ours_v2_to_hf(state: StateDict) -> StateDict:
    """Our V2 keys -> transformers ``Swinv2*`` keys under ``swinv2.`` (the last stage's output
    norm as the final ``layernorm``; transformers' Swinv2 has no other output norms, so the
    others are not written)."""
    return _ours_to_hf(state, v2=True)


# ---------------------------------------------------------------- registered
register_format("hf", hf_to_ours, ours_to_hf)
register_format("hf-v2", hf_to_ours, ours_v2_to_hf)
