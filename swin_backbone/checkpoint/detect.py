"""Which checkpoint format a state dict is, and unwrapping it from what a file holds.

Every format module (:mod:`.formats`: Swin V1, :mod:`.formats_v2`, :mod:`.formats_hf`) is
imported here, so :data:`FORMATS` and the registry's tables (:mod:`.base`) are complete once
this module is.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from collections import Counter
from typing import Iterable, List, Mapping, Optional, Tuple

import torch

from . import formats  # noqa: F401  (registers the Swin V1 layouts)
from .base import FORMAT_NAMES, CheckpointError, StateDict, describe_keys, prefixed
from .formats_hf import hf_root
from .formats_v2 import infer_v2_arch, is_v2, v2_format
from .records import brief

#: Every format name: the V1 layouts (:mod:`.formats`), their Swin V2 variants
#: (:mod:`.formats_v2`), then Hugging Face transformers' (:mod:`.formats_hf`).
FORMATS = tuple(FORMAT_NAMES)

#: Wrapper keys of training frameworks, tried in order.
WRAPPER_KEYS = ("state_dict", "model", "model_state", "module", "state_dict_ema", "model_ema")


def checkpoint_named(source: str) -> str:
    """How messages name a checkpoint: ``checkpoint <source>``, or ``checkpoint`` without one."""
    return f"checkpoint {source}" if source else "checkpoint"


def unwrap_state_dict(obj: object, source: str = "", prefix: Optional[str] = None) -> Tuple[StateDict, List[str]]:
    """Find the tensor dict inside a checkpoint and strip framework prefixes.

    Handles ``{'state_dict': ...}``, ``{'model': ...}``, ``module.`` (DDP) prefixes, full
    detector / segmentor / classifier checkpoints (only ``backbone.*`` is kept; a transformers
    model keeps all its keys: its heads are skipped per key on conversion) and one dict of
    tensors nested under other keys (``{'weights': {'net': ...}}``).

    Args:
        obj: what the checkpoint file holds.
        source: the file, for error messages.
        prefix: keep the keys under this prefix instead of ``backbone.`` / ``encoder.`` (mmengine's
            ``PretrainedInit(prefix=...)``; a trailing ``.`` is added if missing), tried on the keys
            as they are, then without a DDP ``module.``; no key under it is a :class:`CheckpointError`.
    Returns:
        ``(state_dict, steps)``: the backbone's tensors and a description of what was
        unwrapped, for the report.
    """
    where = checkpoint_named(source)
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
    if prefix is not None:
        return _take_prefix(state, prefix, where, steps)
    if all(isinstance(k, str) and k.startswith("module.") for k in state):
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


def _take_prefix(state: StateDict, prefix: str, where: str, steps: List[str]) -> Tuple[StateDict, List[str]]:
    """The keys under an explicit ``prefix`` (as is, else after a DDP ``module.``)."""
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise CheckpointError(f"{where}: prefix: expected the non-empty prefix of a submodule's keys, such as "
                              f"'backbone.', got {prefix!r}")
    prefix = prefix if prefix.endswith(".") else prefix + "."
    for strip in ("", "module."):
        if strip and not all(isinstance(k, str) and k.startswith(strip) for k in state):
            continue
        inner = prefixed(state, strip + prefix)
        if inner:
            kept = f"kept '{strip + prefix}*' (prefix={prefix!r}: {len(inner)} keys, {len(state) - len(inner)} " \
                   "others dropped)"
            return dict(inner), steps + [kept]
    heads = Counter(k.split(".")[0] + "." if "." in k else k for k in state)
    seen = ", ".join(f"{head} ({n})" for head, n in heads.most_common(8))
    raise CheckpointError(f"{where}: prefix={prefix!r}: no key starts with it; the keys start with {seen}")


#: Keys of training state that hold tensors but never the model's weights.
NOT_WEIGHTS = ("optimizer", "optim", "optimizers", "scheduler", "lr_scheduler", "scaler", "amp", "message_hub", "meta")


def _nested_tensor_dict(obj: Mapping, where: str, depth: int = 3) -> Tuple[List[str], Mapping]:
    """The one dict of tensors nested (up to ``depth`` levels) under keys other than the known
    wrappers: ``(path of keys, dict)``; none or several is a :class:`CheckpointError`."""
    found: List[Tuple[List[str], Mapping]] = []

    def walk(node: Mapping, path: List[str], level: int) -> None:
        for key, value in node.items():
            if not isinstance(value, Mapping) or key in NOT_WEIGHTS or not isinstance(key, str):
                continue
            if any(isinstance(v, torch.Tensor) for v in value.values()):
                found.append((path + [key], value))
            elif level < depth:
                walk(value, path + [key], level + 1)

    walk(obj, [], 1)
    keys = ", ".join(brief(k) for k in list(obj)[:8])
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


def infer_arch(checkpoint: Mapping, source: str = "") -> dict:
    """SwinBackbone (or, with ``swin_version=2``, SwinV2Backbone) keyword arguments that match a
    checkpoint's tensors: unwrapped, detected, converted to ours, then read by
    :func:`.formats.infer_v1_arch` / :func:`.formats_v2.infer_v2_arch`.

    Raises:
        CheckpointError: not a Swin checkpoint, or a tensor the architecture is read from is
            missing (the message names ``source``, the file, and the key).
    """
    from .base import swin_version, to_ours
    from .formats import infer_v1_arch

    raw, _ = unwrap_state_dict(checkpoint, source)
    where = checkpoint_named(source)
    fmt = detect_format(raw)
    if fmt == "unknown":
        raise CheckpointError(f"{where}: {describe_unknown(raw)}")
    state, _, _ = to_ours(raw, fmt)
    if swin_version(fmt) == 2:
        return infer_v2_arch(raw, state, where)
    return infer_v1_arch(state, where)
