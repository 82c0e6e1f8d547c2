"""Reading checkpoints (a local file through :mod:`.files`, a URL or other reference through
:mod:`.remote`) and loading them into a SwinBackbone with a per-key report."""
from __future__ import annotations

import logging
import os
import re
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Union

import torch
from mmengine.logging import print_log
from torch import nn

from .base import CheckpointError, StateDict, swin_version, to_ours
from .detect import describe_unknown, detect_format, unwrap_state_dict
from .files import PathLike, read_file
from .remote import is_reference, read_reference
from .resize import (
    adapt_patch_embed_channels,
    pos_embed_grid,
    resize_pos_embed,
    resize_relative_position_bias_table,
    table_window,
)

#: Fewer than this fraction of the model's tensors loaded is an error, not a warning.
MIN_MATCH = 0.5


def read_checkpoint(path: PathLike, map_location: Union[str, torch.device] = "cpu") -> object:
    """Read a checkpoint file as weights only (torch zip / pickle with ``weights_only=True``,
    safetensors without pickle), with errors that say what is wrong.

    ``path`` may also be a URL or another reference mmengine's ``CheckpointLoader`` accepts
    (``torchvision://``, ``open-mmlab://``, ``mmcls://``, storage backends): fetched once into
    torch's hub cache and read from there (:mod:`.remote`). A local path never touches the network.

    Returns:
        What the file holds: a dict (a state dict, or a wrapper such as ``{'state_dict': ...}``).
    Raises:
        CheckpointNotFoundError: no file at ``path`` (also a ``FileNotFoundError``).
        CheckpointError: a directory, an empty / text / random / truncated file, or one torch
            cannot read; a reference that cannot be fetched (unreachable host, HTTP error, stalled or
            cut-off download); the message names the file or reference, what was expected and what was found.
    """
    path = os.fspath(path)
    return read_reference(path, map_location) if is_reference(path) else read_file(path, map_location)


@dataclass
class LoadReport:
    """What happened to every key of a checkpoint.

    Attributes:
        source: file path or ``'<dict>'``.
        format: detected format (see :mod:`swin_backbone.checkpoint.detect`).
        unwrapped: how the backbone's tensors were found in the file.
        loaded: model keys that received a tensor.
        converted: ``key -> how`` for renamed / reordered keys.
        resized: ``key -> 'old shape -> new shape (how)'``.
        skipped: ``checkpoint key -> reason`` for keys dropped on purpose (heads, buffers).
        missing: model keys the checkpoint did not provide.
        unexpected: checkpoint keys (after conversion) the model does not have.
        mismatched: ``key -> 'checkpoint shape vs model shape'`` that could not be resized.
    """

    source: str = "<dict>"
    format: str = "unknown"
    unwrapped: List[str] = field(default_factory=list)
    loaded: List[str] = field(default_factory=list)
    converted: Dict[str, str] = field(default_factory=dict)
    resized: Dict[str, str] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    mismatched: Dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every model tensor was loaded and nothing was left over."""
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self, max_keys: int = 20) -> str:
        """Human-readable multi-line report."""
        total = len(self.loaded) + len(self.missing)
        lines = [
            f"checkpoint {self.source}: format '{self.format}'"
            + (f" ({'; '.join(self.unwrapped)})" if self.unwrapped else ""),
            f"  loaded     {len(self.loaded)}/{total} model tensors",
        ]

        def section(name: str, items: Union[List[str], Dict[str, str]]) -> None:
            if not items:
                return
            lines.append(f"  {name:<10} {len(items)}")
            entries = list(items.items()) if isinstance(items, dict) else [(k, "") for k in items]
            for key, how in entries[:max_keys]:
                lines.append(f"    {key}" + (f": {how}" if how else ""))
            if len(entries) > max_keys:
                lines.append(f"    ... and {len(entries) - max_keys} more")

        section("converted", self.converted)
        section("resized", self.resized)
        section("skipped", self.skipped)
        section("missing", self.missing)
        section("unexpected", self.unexpected)
        section("mismatched", self.mismatched)
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _model_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return model.state_dict(keep_vars=False)


def replace_meta_tensors(model: nn.Module, value_for: Callable[[str, torch.Tensor], Optional[torch.Tensor]],
                         buffers: bool = True) -> None:
    """Give each meta parameter (and buffer) of ``model`` the tensor ``value_for(name, meta_tensor)``
    returns (``None``: it stays on meta). A parameter stays a parameter with its ``requires_grad``;
    a tensor shared by two modules stays shared (the first value it is given)."""
    given: Dict[int, torch.Tensor] = {}  # id of a meta tensor -> what it became
    for name, module in model.named_modules():
        for kind in ("_parameters", "_buffers") if buffers else ("_parameters",):
            tensors = getattr(module, kind)
            for key, old in list(tensors.items()):
                if old is None or not old.is_meta:
                    continue
                new = value_for(f"{name}.{key}" if name else key, old)
                if id(old) not in given and new is not None:
                    given[id(old)] = type(old)(new, requires_grad=old.requires_grad) if kind == "_parameters" else new
                if id(old) in given:
                    tensors[key] = given[id(old)]


def assign_to_meta(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Give the tensors of ``model`` that are on the meta device (built without values, e.g.
    under ``with torch.device('meta'):``) the checkpoint's tensors: copies in the model tensor's
    dtype, on the checkpoint's device (``map_location``), so nothing aliases the caller's
    tensors. Returns the rest of ``state``, for ``load_state_dict`` (which would copy into a meta
    tensor as a no-op)."""
    rest = dict(state)

    def take(name: str, old: torch.Tensor) -> Optional[torch.Tensor]:
        value = rest.pop(name, None)
        return None if value is None else value.detach().to(dtype=old.dtype, copy=True)

    replace_meta_tensors(model, take)
    return rest


def adapt_to_model(state: StateDict, target: Mapping[str, torch.Tensor], report: LoadReport) -> StateDict:
    """Resize tensors whose shape differs from the model's where that is meaningful.

    Handles relative-position-bias tables (other window), absolute position embeddings
    (other grid or layout) and the patch-embedding conv (other ``in_channels``).
    ``target`` is the model's state dict.
    """
    out: StateDict = OrderedDict()
    for key, value in state.items():
        want = target.get(key)
        new = value
        how = ""
        if want is None:
            out[key] = value
            continue
        if key.endswith("relative_position_bias_table") and value.shape != want.shape and value.dim() == 2:
            if value.shape[1] == want.shape[1]:
                new = resize_relative_position_bias_table(value, table_window(want.shape[0]))
                how = f"bicubic, window {table_window(value.shape[0])[0]} -> {table_window(want.shape[0])[0]}"
        elif key == "absolute_pos_embed" and value.shape != want.shape:
            grid = tuple(want.shape[-2:])
            new = resize_pos_embed(pos_embed_grid(value, grid), grid)
            how = "reshaped to a grid" + (", bicubic" if new.shape != value.shape else "")
        elif key == "patch_embed.proj.weight" and value.shape != want.shape and value.shape[0] == want.shape[0] \
                and value.shape[2:] == want.shape[2:]:
            new = adapt_patch_embed_channels(value, want.shape[1])
            how = f"in_channels {value.shape[1]} -> {want.shape[1]}"
        if how and new.shape == want.shape:
            report.resized[key] = f"{tuple(value.shape)} -> {tuple(new.shape)} ({how})"
        out[key] = new
    return out


def check_swin_version(fmt: str, model: nn.Module, source: str = "<dict>") -> None:
    """Refuse a Swin V1 checkpoint for a V2 model and the reverse (never a partial load)."""
    have, want = swin_version(fmt), getattr(model, "swin_version", 1)
    if have != want:
        names = {1: "Swin V1 (SwinBackbone)", 2: "Swin V2 (SwinV2Backbone)"}
        raise CheckpointError(
            f"checkpoint {source}: a {names[have]} checkpoint (format '{fmt}') cannot be loaded into "
            f"{type(model).__name__}, a {names[want]} model: V1 and V2 differ in the attention "
            f"(bias table vs cosine attention with cpb_mlp / logit_scale) and the norm placement; "
            f"use {'SwinV2Backbone' if have == 2 else 'SwinBackbone'} for this checkpoint"
        )


def prepare_state_dict(checkpoint: Mapping, model: nn.Module, source: str = "<dict>",
                       prefix: Optional[str] = None) -> tuple:
    """Unwrap, detect, convert and resize a checkpoint for ``model``.

    ``prefix``: take the keys under it (mmengine's ``PretrainedInit(prefix=...)``, e.g.
    ``'backbone.'`` or ``'teacher.backbone.'``) instead of finding the backbone's keys
    (:func:`~swin_backbone.checkpoint.unwrap_state_dict`).

    Returns:
        ``(state_dict, report)``: every tensor in our key names, resized to the model where
        possible, and a :class:`LoadReport` with everything but ``loaded`` / ``missing``
        filled; keys the model lacks are in ``report.unexpected``, tensors that still do not
        fit in ``report.mismatched``.
    """
    report = LoadReport(source=source)
    raw, report.unwrapped = unwrap_state_dict(checkpoint, source, prefix=prefix)
    report.format = detect_format(raw)
    if report.format == "unknown":
        raise CheckpointError(f"checkpoint {source}: {describe_unknown(raw)}")
    check_swin_version(report.format, model, source)
    state, report.converted, report.skipped = to_ours(raw, report.format)
    target = _model_state(model)
    state = adapt_to_model(state, target, report)
    for key, value in state.items():
        if key not in target:
            report.unexpected.append(key)
        elif value.shape != target[key].shape:
            report.mismatched[key] = f"checkpoint {tuple(value.shape)} vs model {tuple(target[key].shape)}"
    return state, report


#: The layouts mmdet's / mmseg's SwinTransformer read themselves (official: with
#: ``convert_weights=True``): where ``init_cfg`` ``Pretrained`` loads as they do.
LIBRARY_LAYOUTS = ("official", "mmdet")


def _skip_final_norm(state: Dict[str, torch.Tensor], report: LoadReport) -> None:
    """Take a classifier's final norm (converted from ``norm.*`` to ``norm{last}.*``) out of
    ``state``, into ``report.skipped``."""
    for key, how in list(report.converted.items()):
        m = re.match(r"renamed from (norm\.(?:weight|bias))(?: |$)", how)
        if m and re.fullmatch(r"norm\d+\.(weight|bias)", key):
            del state[key], report.converted[key]
            report.skipped[m.group(1)] = ("the classifier's final norm: mmdet's / mmseg's SwinTransformer do not load "
                                          f"it into {key.split('.')[0]} (init_cfg Pretrained loads as they do)")


#: Swin V2 formats whose source models shrink the window to small maps and drop the shift
#: (Swin V2's rule: official, timm, torchvision, transformers, mmpretrain); ours may be either.
V2_SHRINKING_FORMATS = ("official-v2", "timm-v2", "torchvision-v2", "hf-v2", "mmpretrain-v2")


def note_small_map_rule(model: nn.Module, fmt: str, source: str = "<dict>") -> None:
    """Warn once per model where its explicit ``pad_small_map=True`` makes a loaded Swin V2
    checkpoint's features differ from its source model's: stages whose map is not larger than
    the window (at the pretraining size 256x256, window 8: stage 4) pad and shift there, the
    source model shrinks the window and does not shift (SwinV2Backbone's default does the same)."""
    if fmt not in V2_SHRINKING_FORMATS or not getattr(model, "pad_small_map", False):
        return
    if getattr(model, "_said_small_map_rule", False):
        return
    model._said_small_map_rule = True  # type: ignore[assignment]
    windows = sorted(set(getattr(model, "window_sizes", ()) or ()))
    warnings.warn(
        f"{type(model).__name__}(pad_small_map=True) with checkpoint {source} (format '{fmt}'): the checkpoint's "
        "model uses Swin V2's small-map rule (where a stage's map is not larger than the window "
        f"{'/'.join(map(str, windows)) or ''}, the window shrinks to it and the shift is off; at its 256x256 "
        "pretraining size: stage 4), this model pads and shifts there, so those stages' features differ from "
        "the checkpoint's model; pad_small_map=False (SwinV2Backbone's default) gives them, without image-exact "
        "batches (valid_sizes)",
        UserWarning, stacklevel=3,
    )


def load_checkpoint(
    model: nn.Module,
    checkpoint: Union[str, os.PathLike, Mapping],
    map_location: Union[str, torch.device] = "cpu",
    strict: bool = False,
    min_match: float = MIN_MATCH,
    logger: Optional[str] = "current",
    final_norm: bool = True,
    prefix: Optional[str] = None,
) -> LoadReport:
    """Load any supported Swin checkpoint into a :class:`~swin_backbone.SwinBackbone`.

    Args:
        model: the backbone.
        checkpoint: a file path or an already loaded dict (any wrapper / prefix).
        map_location: passed to ``torch.load``.
        strict: raise if anything is missing, unexpected or mismatched.
        min_match: raise if fewer than this fraction of the model's tensors load.
        logger: mmengine logger name for the report (``None``: don't log).
        final_norm: a classification checkpoint's final ``norm.*`` becomes the last stage's
            output norm (the source model's features). ``False``, for the layouts mmdet /
            mmseg read themselves (official, mmdet / mmseg): it is skipped, as their
            ``SwinTransformer`` leaves it (``init_cfg`` ``Pretrained`` does this, so a config
            switched to SwinBackbone starts from the weights the library would load).
        prefix: load the keys under this prefix (a trailing ``.`` added if missing), as
            mmengine's ``PretrainedInit(prefix=...)``: e.g. ``'teacher.backbone.'`` of a
            distillation checkpoint; ``None``: the backbone's keys are found
            (:func:`~swin_backbone.checkpoint.unwrap_state_dict`). No key under it is an error.
    Returns:
        The :class:`LoadReport`.
    Raises:
        CheckpointError: unreadable file, unknown format, too few tensors matched, or
            (``strict``) an incomplete load; the message names the format and keys.
    """
    source = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else "<dict>"
    obj = read_checkpoint(checkpoint, map_location) if isinstance(checkpoint, (str, os.PathLike)) else checkpoint
    state, report = prepare_state_dict(obj, model, source, prefix=prefix)
    if not final_norm and report.format in LIBRARY_LAYOUTS:
        _skip_final_norm(state, report)
    target = _model_state(model)
    state = {k: v for k, v in state.items() if k in target and k not in report.mismatched}
    report.loaded = [k for k in target if k in state]
    report.missing = [k for k in target if k not in state]
    if len(report.loaded) < min_match * len(target):
        raise CheckpointError(
            f"checkpoint {source}: detected format '{report.format}' but only {len(report.loaded)} of the "
            f"model's {len(target)} tensors match (wrong architecture?).\n{report.summary(max_keys=8)}"
        )
    if strict and not report.complete:
        raise CheckpointError(f"checkpoint {source}: incomplete load with strict=True\n{report.summary()}")
    with torch.no_grad():
        model.load_state_dict(assign_to_meta(model, state), strict=False)
    empty = [k for k, t in _model_state(model).items() if t.is_meta]
    if empty:
        warnings.warn(f"load_checkpoint: {source} gave no value to {len(empty)} tensor(s) of a model built on the meta "
                      f"device; they stay there without values (give them memory and values before running the "
                      f"model): {empty[:8]}{' ...' if len(empty) > 8 else ''}", stacklevel=2)
    note_small_map_rule(model, report.format, source)
    if logger is not None:
        level = logging.INFO if report.complete else logging.WARNING
        print_log(report.summary(), logger=logger, level=level)
    return report
