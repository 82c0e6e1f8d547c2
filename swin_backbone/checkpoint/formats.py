"""Swin checkpoint formats: unwrapping, detection, and key conversion to and from ours.

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

mmcls 0.x / mmpretrain files of state-dict version < 2 store the last stage's norm as ``norm.*``
(mmpretrain renames it on load): read as ``norm{last}``, as for the classification layouts.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Mapping, MutableMapping, Tuple

import torch

StateDict = Dict[str, torch.Tensor]

FORMATS = ("ours", "official", "mmdet", "timm", "torchvision")

#: Wrapper keys of training frameworks, tried in order.
WRAPPER_KEYS = ("state_dict", "model", "model_state", "module", "state_dict_ema", "model_ema")

#: Buffers that some formats save; ours recomputes them per size.
BUFFER_SUFFIXES = ("relative_position_index", "attn_mask", "relative_coords_table")


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unreadable, not Swin, or of another architecture."""


def unwrap_state_dict(obj: object, source: str = "") -> Tuple[StateDict, List[str]]:
    """Find the tensor dict inside a checkpoint and strip framework prefixes.

    Handles ``{'state_dict': ...}``, ``{'model': ...}``, ``module.`` (DDP) prefixes, full
    detector / segmentor / classifier checkpoints (only ``backbone.*`` is kept; a transformers
    model keeps all its keys: its heads are skipped per key on conversion) and one dict of
    tensors nested under other keys (``{'weights': {'net': ...}}``).

    Args:
        obj: what the checkpoint file holds.
        source: the file, for error messages.
    Returns:
        ``(state_dict, steps)``: the backbone's tensors and a description of what was
        unwrapped, for the report.
    """
    where = f"checkpoint {source}" if source else "checkpoint"
    steps: List[str] = []
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{where}: expected a dict of tensors (a state dict), got {type(obj).__name__}")
    for key in WRAPPER_KEYS:
        inner = obj.get(key)
        if isinstance(inner, Mapping) and any(isinstance(v, torch.Tensor) for v in inner.values()):
            obj = inner
            steps.append(f"took '{key}'")
            break
    state = OrderedDict((k, v) for k, v in obj.items() if isinstance(v, torch.Tensor))
    if not state:
        path, obj = _nested_tensor_dict(obj, where)
        steps.append("took '" + "' -> '".join(path) + "'")
        state = OrderedDict((k, v) for k, v in obj.items() if isinstance(v, torch.Tensor))
    if all(str(k).startswith("module.") for k in state):
        state = OrderedDict((k[len("module."):], v) for k, v in state.items())
        steps.append("stripped 'module.'")
    if hf_root(state) is None:
        for prefix in ("backbone.", "encoder."):
            inner = prefixed(state, prefix)
            if inner:
                steps.append(f"kept '{prefix}*' ({len(inner)} keys, {len(state) - len(inner)} others dropped)")
                state = inner
                break
    return dict(state), steps


#: Keys of training state that hold tensors but never the model's weights.
NOT_WEIGHTS = ("optimizer", "optim", "optimizers", "scheduler", "lr_scheduler", "scaler", "amp", "message_hub", "meta")


def _nested_tensor_dict(obj: Mapping, where: str, depth: int = 3) -> Tuple[List[str], Mapping]:
    """The one dict of tensors nested (up to ``depth`` levels) under keys other than the known
    wrappers: ``(path of keys, dict)``; none or several is a :class:`CheckpointError`."""
    found: List[Tuple[List[str], Mapping]] = []

    def walk(node: Mapping, path: List[str], level: int) -> None:
        for key, value in node.items():
            if not isinstance(value, Mapping) or str(key) in NOT_WEIGHTS:
                continue
            if any(isinstance(v, torch.Tensor) for v in value.values()):
                found.append((path + [str(key)], value))
            elif level < depth:
                walk(value, path + [str(key)], level + 1)

    walk(obj, [], 1)
    keys = ", ".join(map(repr, list(obj)[:8]))
    if not found:
        raise CheckpointError(
            f"{where}: expected a dict of tensors (a state dict, maybe under 'state_dict' or 'model'); "
            f"found no tensors (top-level keys: {keys})"
        )
    if len(found) > 1:
        paths = ", ".join("'" + ".".join(p) + f"' ({len(d)} entries)" for p, d in found[:6])
        raise CheckpointError(
            f"{where}: expected one dict of tensors; found several nested ones ({paths}): "
            "pass the one with the backbone's weights (a dict) to load_checkpoint"
        )
    return found[0]


_LAYER_DOWNSAMPLE = re.compile(r"^layers\.(\d+)\.downsample\.")


def detect_format(keys: Iterable[str]) -> str:
    """Name of the format of an unwrapped state dict's keys, or ``'unknown'``; Swin V2
    checkpoints get their layout's name with ``-v2`` (:mod:`.formats_v2`)."""
    keys = list(keys)
    layout = detect_layout(keys)
    return v2_format(layout) if layout != "unknown" and is_v2(keys) else layout


def detect_layout(keys: Iterable[str]) -> str:
    """Name of the key layout (V1 format names), or ``'unknown'``."""
    keys = list(keys)
    if hf_root(keys) is not None:
        return "hf"
    if any(re.match(r"^features\.\d+\.\d+\.attn\.qkv\.", k) for k in keys):
        return "torchvision"
    if any(".attn.w_msa." in k or ".ffn.layers." in k or k.startswith("patch_embed.projection.") for k in keys):
        return "mmdet"
    if any(re.match(r"^layers\.\d+\.blocks\.\d+\.", k) for k in keys):
        downsample_stages = {int(m.group(1)) for m in map(_LAYER_DOWNSAMPLE.match, keys) if m}
        if 0 in downsample_stages:
            return "official"
        if downsample_stages or any(k.startswith("head.fc.") for k in keys):
            return "timm"
        return "official"
    if any(re.match(r"^stages\.\d+\.blocks\.\d+\.attn\.qkv\.", k) for k in keys):
        return "ours"
    return "unknown"


def _num_stages(keys: Iterable[str], pattern: str) -> int:
    found = [int(m.group(1)) for m in map(re.compile(pattern).match, keys) if m]
    return max(found) + 1 if found else 0


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
Rule = Tuple[str, str]


Converted = Tuple[StateDict, Dict[str, str], Dict[str, str]]


def _rename(state: StateDict, rules: List[Rule], drop: Callable[[str], str]) -> Converted:
    """Apply regex renames in order; ``drop(key)`` returns a reason to skip a key, or ''.

    Returns ``(state, converted: new key -> how, skipped: old key -> why)``.
    """
    out: StateDict = OrderedDict()
    notes: Dict[str, str] = {}
    skipped: Dict[str, str] = {}
    for key, value in state.items():
        reason = drop(key)
        if reason:
            skipped[key] = reason
            continue
        new = key
        for pattern, repl in rules:
            new = re.sub(pattern, repl, new)
        out[new] = value
        if new != key:
            notes[new] = f"renamed from {key}"
    return out, notes, skipped


def _drop_common(key: str) -> str:
    if key.endswith(BUFFER_SUFFIXES):
        return "buffer, recomputed per input size"
    if key.startswith("head.") or key.startswith("fc_norm.") or key == "head":
        return "classification head"
    return ""


def _final_norm_rule(num_stages: int) -> Rule:
    # The classification model's final norm is the last stage's output norm.
    return (r"^norm\.", f"norm{num_stages - 1}.")


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


def mmdet_to_ours(state: StateDict) -> Converted:
    n = _num_stages(state, r"^stages\.(\d+)\.")
    rules = [
        (r"^patch_embed\.projection\.", "patch_embed.proj."),
        (r"\.attn\.w_msa\.", ".attn."),
        (r"\.ffn\.layers\.0\.0\.", ".mlp.fc1."),
        (r"\.ffn\.layers\.1\.", ".mlp.fc2."),
        _final_norm_rule(n),  # mmcls 0.x / mmpretrain state-dict version < 2
    ]
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


TO_OURS: Dict[str, Callable[[StateDict], Converted]] = {
    "ours": ours_to_ours,
    "official": official_to_ours,
    "mmdet": mmdet_to_ours,
    "timm": timm_to_ours,
    "torchvision": torchvision_to_ours,
}


def to_ours(state: StateDict, fmt: str) -> Converted:
    """Convert an unwrapped state dict of format ``fmt`` to our key names and layouts."""
    if fmt not in TO_OURS:
        raise CheckpointError(f"format: expected one of {FORMATS}, got {fmt!r}")
    return TO_OURS[fmt](state)


# ---------------------------------------------------------------- conversion from ours
def ours_to_official(state: StateDict) -> StateDict:
    """Our keys -> the official detection layout (``layers.{i}``, ``norm{i}``).

    Absolute position embeddings stay ``(1, C, Gh, Gw)`` as in the official detection repo.
    """
    return OrderedDict((re.sub(r"^stages\.", "layers.", k), v) for k, v in state.items())


def ours_to_mmdet(state: StateDict) -> StateDict:
    """Our keys -> mmdet 3.x / mmseg 1.x ``SwinTransformer`` keys (nn.Unfold order).

    The absolute position embedding becomes mmdet's ``(1, Gh * Gw, C)``.
    """
    rules = [
        (r"^patch_embed\.proj\.", "patch_embed.projection."),
        (r"\.attn\.(qkv|proj|relative_position_bias_table)", r".attn.w_msa.\1"),
        (r"\.mlp\.fc1\.", ".ffn.layers.0.0."),
        (r"\.mlp\.fc2\.", ".ffn.layers.1."),
    ]
    out: StateDict = OrderedDict()
    for key, value in state.items():
        new = key
        for pattern, repl in rules:
            new = re.sub(pattern, repl, new)
        if _MERGE_CHANNELS.search(key):
            value = official_to_unfold(value)
        if key == "absolute_pos_embed" and value.dim() == 4:
            value = value.flatten(2).transpose(1, 2)
        out[new] = value
    return out


FROM_OURS: Dict[str, Callable[[StateDict], StateDict]] = {
    "ours": lambda s: OrderedDict(s),
    "official": ours_to_official,
    "mmdet": ours_to_mmdet,
}


def stage_depths(state: Iterable[str], source: str = "checkpoint") -> List[int]:
    """Blocks per stage of a state dict in our keys (``stages.{i}.blocks.{j}.``): the highest
    block index + 1 of each stage; a stage with no block between others is a
    :class:`CheckpointError` naming ``source``."""
    blocks: Dict[int, int] = {}
    for m in map(re.compile(r"^stages\.(\d+)\.blocks\.(\d+)\.").match, state):
        if m:
            i, j = int(m.group(1)), int(m.group(2))
            blocks[i] = max(blocks.get(i, 0), j + 1)
    depths = []
    while len(depths) in blocks:
        depths.append(blocks[len(depths)])
    if len(depths) < len(blocks):
        raise CheckpointError(
            f"{source}: no 'stages.{len(depths)}.blocks.*' tensors but stages up to {max(blocks)} have some; "
            "cannot infer the architecture (the checkpoint is missing keys)"
        )
    return depths


def stage_tensor(state: Mapping[str, torch.Tensor], stage: int, suffix: str, source: str = "checkpoint") -> torch.Tensor:
    """``stages.{stage}.blocks.{j}.{suffix}`` of the first block ``j`` that has it (a per-stage
    shape such as the number of heads); :class:`CheckpointError` naming the key if none has."""
    pattern = re.compile(rf"^stages\.{stage}\.blocks\.\d+\.{re.escape(suffix)}$")
    key = next((k for k in state if pattern.match(k)), None)
    if key is None:
        raise CheckpointError(
            f"{source}: no 'stages.{stage}.blocks.*.{suffix}' tensor in any block of stage {stage}; "
            "cannot infer the architecture (the checkpoint is missing keys)"
        )
    return state[key]


def describe_keys(keys: Iterable[str], limit: int = 6) -> str:
    """A short sample of keys for error messages."""
    keys = list(keys)
    sample = ", ".join(keys[:limit])
    return sample + (f", ... ({len(keys)} keys)" if len(keys) > limit else "")


#: What a non-Swin state dict looks like, for the "unknown format" error: (key pattern, description).
_LOOKS_LIKE = [
    (r"^(\w+)\.(?:embeddings|encoder)\.", "a Hugging Face transformers '{0}' model (not Swin)"),
    (r"^(?:embeddings\.patch_embeddings|(?:encoder\.)?layer\.\d+\.attention\.)",
     "a Hugging Face transformers model (not Swin)"),
    (r"(^|\.)(cls_token|pos_embed)$", "a plain ViT (timm / DeiT / MAE layout)"),
    (r"\.(conv_dw|dwconv)\.", "a ConvNeXt"),
    (r"^layer1\.0\.conv1\.", "a ResNet"),
]

#: The formats in words, for error messages.
KNOWN_FORMATS = ("ours, official, mmdet / mmseg / mmcls / mmpretrain, timm, torchvision, "
                 "Hugging Face transformers; Swin V1 and V2")


def describe_unknown(keys: Iterable[str]) -> str:
    """``"not a Swin Transformer checkpoint ...; it looks like ...; keys seen: ..."``."""
    keys = list(keys)
    looks = ""
    for pattern, what in _LOOKS_LIKE:
        m = next((m for m in map(re.compile(pattern).search, keys) if m), None)
        if m:
            looks = "; it looks like " + what.format(*m.groups())
            break
    return (f"not a Swin Transformer checkpoint of any known format ({KNOWN_FORMATS}){looks}; "
            f"keys seen: {describe_keys(keys)}")


def prefixed(state: MutableMapping[str, torch.Tensor], prefix: str) -> StateDict:
    """The entries of ``state`` under ``prefix``, with the prefix removed."""
    return OrderedDict((k[len(prefix):], v) for k, v in state.items() if k.startswith(prefix))


# ---------------------------------------------------------------- Swin V2 (formats_v2.py)
from .formats_v2 import V2_FORMATS, V2_FROM_OURS, V2_TO_OURS, is_v2, v2_format  # noqa: E402

FORMATS = FORMATS + V2_FORMATS
TO_OURS.update(V2_TO_OURS)

# ---------------------------------------------------------------- transformers (formats_hf.py)
from .formats_hf import HF_FORMATS, HF_TO_OURS, hf_root, ours_to_hf, ours_v2_to_hf  # noqa: E402

FORMATS = FORMATS + HF_FORMATS
TO_OURS.update(HF_TO_OURS)
FROM_OURS["hf"] = ours_to_hf
V2_FROM_OURS["hf"] = ours_v2_to_hf
