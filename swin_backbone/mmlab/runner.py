"""mmengine Runner glue that needs nothing above this layer: the config's scope
(:func:`config_scope`, read by :mod:`swin_backbone.features` too) and the check that a
checkpoint fits the model a Runner loads it into (:func:`require_checkpoint_match`, for
tools/test.py).

The rest of what tools/train.py and tools/test.py share (config loading, the Runner's
environment, AMP, resuming) is in :mod:`swin_backbone.tools.runner`.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

from mmengine.config import Config

SCOPES = ("mmdet", "mmseg")


def config_scope(cfg: Config) -> str:
    """``'mmdet'`` or ``'mmseg'``, from the config's ``default_scope``."""
    scope = cfg.get("default_scope")
    if scope not in SCOPES:
        raise ValueError(
            f"config default_scope: expected one of {SCOPES} (set by the mmdet:: / mmseg:: base configs), "
            f"got {scope!r}"
        )
    return scope


# ---------------------------------------------------------------------------- checkpoint match (tools/test.py)
#: Evaluating a checkpoint that gives fewer than this fraction of the model's tensors (or of its
#: backbone's) a value of their shape is an error: the rest would be random weights.
MIN_MATCH = 0.5


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit the model it is loaded into (another architecture)."""


def _examples(keys: Sequence[str], limit: int = 3) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def match_report(model_keys: Sequence[str], missing: Sequence[str], unexpected: Sequence[str],
                 errors: Sequence[str], checkpoint: str, min_match: float = MIN_MATCH) -> Optional[str]:
    """``None`` if at least ``min_match`` of the model's tensors (and of its ``backbone.``
    ones) loaded with their shape, else the error message: counts, and examples of the missing,
    wrongly shaped and unexpected keys."""
    keys = [k for k in model_keys if not k.endswith("num_batches_tracked")]
    mismatched = set(re.findall(r"size mismatch for ([^:\s]+):", "\n".join(map(str, errors))))
    absent = set(missing) | mismatched
    loaded = [k for k in keys if k not in absent]
    backbone = [k for k in keys if k.startswith("backbone.")]
    backbone_loaded = [k for k in backbone if k not in absent]
    low = len(loaded) < min_match * len(keys) or (backbone and len(backbone_loaded) < min_match * len(backbone))
    if not low:
        return None
    parts = [f"{len(set(missing) & set(keys))} missing (e.g. {_examples(set(missing) & set(keys))})"]
    if mismatched:
        parts.append(f"{len(mismatched)} of another shape (e.g. {_examples(mismatched)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {_examples(unexpected)})")
    return (f"checkpoint {checkpoint!r}: expected weights for this config's model, got a checkpoint that gives only "
            f"{len(loaded)} of its {len(keys)} tensors a value" + (f" (backbone: {len(backbone_loaded)} of "
            f"{len(backbone)})" if backbone else "") + f", under the {min_match:.0%} needed; " + "; ".join(parts)
            + ". It is probably for another architecture or task; the rest would be evaluated with random weights")


def require_checkpoint_match(runner, checkpoint: str, min_match: float = MIN_MATCH) -> None:
    """Make the Runner's loading of ``checkpoint`` (``load_from``) raise
    :class:`CheckpointMismatchError` when it matches too little of the model (:func:`match_report`).

    mmengine loads with ``strict=False`` and only logs what did not fit; the lists it collects
    are caught by a pre-hook on the model (the first module loaded) and judged by a post-hook
    (the last), so the check sees exactly what mmengine (and our key-converting hooks) did."""
    from mmengine.model import is_model_wrapper

    from ..torch_compat import register_load_state_dict_pre_hook

    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    seen: dict = {}

    def record(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        if prefix == "":
            seen.update(missing=missing, unexpected=unexpected, errors=errors)

    def judge(module, incompatible) -> None:
        if not seen:
            return
        message = match_report(list(module.state_dict()), seen["missing"], seen["unexpected"], seen["errors"],
                               checkpoint, min_match)
        seen.clear()
        if message:
            raise CheckpointMismatchError(message)

    register_load_state_dict_pre_hook(model, record)
    model.register_load_state_dict_post_hook(judge)
