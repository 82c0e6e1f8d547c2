"""The checkpoint formats' registry, and what the format modules share.

Each format module registers its layouts with :func:`register_format`: Swin V1 in
:mod:`.formats`, Swin V2 in :mod:`.formats_v2`, Hugging Face transformers in
:mod:`.formats_hf`; :mod:`.detect` imports all three and tells the formats apart. Imports
inside ``checkpoint/`` go one way, function-level imports included (tests/checkpoint/
test_checkpoint_cache.py checks it): ``base`` and ``resize`` (which needs nothing) <- ``formats``
<- ``formats_v2`` <- ``formats_hf`` <- ``detect``; ``base`` <- ``files`` (local files) <- ``remote``
(URLs and other references); ``detect``, ``files``, ``remote`` and ``resize`` <- ``loading`` <-
``hooks`` and ``mmengine_schemes``; ``records`` (the unpickler's table, needing ``base``) <- ``unpickler`` <-
``files``.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Mapping, MutableMapping, Optional, Tuple

import torch

StateDict = Dict[str, torch.Tensor]

#: ``(state, converted: new key -> how, skipped: old key -> why)``, what a ``*_to_ours`` returns.
Converted = Tuple[StateDict, Dict[str, str], Dict[str, str]]

#: A regex rename: ``(pattern, replacement)`` (a string or a function of the match).
Rule = Tuple[str, str]

#: Buffers that some formats save; ours recomputes them per size.
BUFFER_SUFFIXES = ("relative_position_index", "attn_mask", "relative_coords_table")


class CheckpointError(ValueError):
    """A checkpoint cannot be used: unreadable, not Swin, or of another architecture."""


# ---------------------------------------------------------------- the registry
#: Every format name, in registration order (:data:`~swin_backbone.checkpoint.FORMATS`).
FORMAT_NAMES: List[str] = []

#: Format name -> its conversion to ours.
TO_OURS: Dict[str, Callable[[StateDict], Converted]] = {}

#: Layouts a Swin V1 model's weights can be written in: layout -> conversion from ours.
FROM_OURS: Dict[str, Callable[[StateDict], StateDict]] = {}

#: The same for Swin V2 (layout names without ``-v2``).
V2_FROM_OURS: Dict[str, Callable[[StateDict], StateDict]] = {}


def swin_version(fmt: str) -> int:
    """1 or 2: the Swin version of a detected format name."""
    return 2 if fmt.endswith("-v2") else 1


def register_format(
    name: str,
    to_ours: Callable[[StateDict], Converted],
    from_ours: Optional[Callable[[StateDict], StateDict]] = None,
) -> None:
    """Register format ``name`` (``'<layout>'`` for Swin V1, ``'<layout>-v2'`` for V2): its
    conversion to ours and, where our weights can be written in it, from ours (a target of
    ``swin-convert-checkpoint --to <layout>``)."""
    if name not in TO_OURS:
        FORMAT_NAMES.append(name)
    TO_OURS[name] = to_ours
    if from_ours is not None:
        v2 = swin_version(name) == 2
        (V2_FROM_OURS if v2 else FROM_OURS)[name[: -len("-v2")] if v2 else name] = from_ours


def to_ours(state: StateDict, fmt: str) -> Converted:
    """Convert an unwrapped state dict of format ``fmt`` to our key names and layouts."""
    if fmt not in TO_OURS:
        raise CheckpointError(f"format: expected one of {tuple(FORMAT_NAMES)}, got {fmt!r}")
    return TO_OURS[fmt](state)


# ---------------------------------------------------------------- shared by the format modules
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
        new = rewrite_key(key, rules)
        out[new] = value
        if new != key:
            notes[new] = f"renamed from {key}"
    return out, notes, skipped


def rewrite_key(key: str, rules: Iterable[Rule]) -> str:
    """``key`` with each ``(pattern, replacement)`` of ``rules`` applied in order (``re.sub``):
    the one way keys are rewritten, to ours (:func:`_rename`) and from ours."""
    for pattern, repl in rules:
        key = re.sub(pattern, repl, key)
    return key


def _drop_common(key: str) -> str:
    if key.endswith(BUFFER_SUFFIXES):
        return "buffer, recomputed per input size"
    if key.startswith("head.") or key.startswith("fc_norm.") or key == "head":
        return "classification head"
    return ""


def _final_norm_rule(num_stages: int) -> Rule:
    # The classification model's final norm is the last stage's output norm.
    return (r"^norm\.", f"norm{num_stages - 1}.")


def _num_stages(keys: Iterable[str], pattern: str) -> int:
    found = [int(m.group(1)) for m in map(re.compile(pattern).match, keys) if m]
    return max(found) + 1 if found else 0


def prefixed(state: MutableMapping[str, torch.Tensor], prefix: str) -> StateDict:
    """The entries of ``state`` under ``prefix``, with the prefix removed."""
    return OrderedDict((k[len(prefix):], v) for k, v in state.items() if k.startswith(prefix))


def describe_keys(keys: Iterable[str], limit: int = 6) -> str:
    """A short sample of keys for error messages."""
    keys = list(keys)
    sample = ", ".join(keys[:limit])
    return sample + (f", ... ({len(keys)} keys)" if len(keys) > limit else "")


# ---------------------------------------------------------------- architecture from our keys
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


def stage_tensor(state: Mapping[str, torch.Tensor], stage: int, suffix: str,
                 source: str = "checkpoint") -> torch.Tensor:
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
