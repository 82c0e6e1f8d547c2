"""Whole-file conversion: infer the architecture, load with a report, write another layout."""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional

import torch

from .formats import FROM_OURS, CheckpointError, detect_format, to_ours, unwrap_state_dict
from .formats_v2 import V2_FROM_OURS, infer_v2_arch, swin_version
from .loading import LoadReport, load_checkpoint, read_checkpoint
from .resize import table_window


def infer_arch(checkpoint: Mapping) -> dict:
    """SwinBackbone keyword arguments that match a checkpoint's tensors.

    Reads embed_dims, depths, heads, window, patch size, input channels, absolute position
    embedding and output norms from the shapes in the (converted) state dict.
    """
    raw, _ = unwrap_state_dict(checkpoint)
    fmt = detect_format(raw)
    if fmt == "unknown":
        raise CheckpointError("checkpoint: not a Swin Transformer checkpoint of any known format")
    state, _, _ = to_ours(raw, fmt)
    if swin_version(fmt) == 2:
        return infer_v2_arch(raw, state)
    proj = state.get("patch_embed.proj.weight")
    if proj is None:
        raise CheckpointError("checkpoint: no patch_embed.proj weight; cannot infer the architecture")
    depths = []
    heads = []
    window = None
    stage = 0
    while any(k.startswith(f"stages.{stage}.blocks.") for k in state):
        blocks = {int(m.group(1)) for m in (re.match(rf"stages\.{stage}\.blocks\.(\d+)\.", k) for k in state) if m}
        depths.append(max(blocks) + 1)
        table = state[f"stages.{stage}.blocks.0.attn.relative_position_bias_table"]
        heads.append(int(table.shape[1]))
        window = window or table_window(table.shape[0])[0]
        stage += 1
    kwargs = dict(
        arch=None,
        embed_dims=int(proj.shape[0]),
        depths=tuple(depths),
        num_heads=tuple(heads),
        in_channels=int(proj.shape[1]),
        patch_size=int(proj.shape[-1]),
        window_size=window,
        out_indices=tuple(i for i in range(len(depths)) if f"norm{i}.weight" in state) or (len(depths) - 1,),
        use_abs_pos_embed="absolute_pos_embed" in state,
    )
    if kwargs["use_abs_pos_embed"]:
        pos = state["absolute_pos_embed"]
        grid = pos.shape[-2:] if pos.dim() == 4 else (int(pos.shape[1] ** 0.5),) * 2
        kwargs["pretrain_img_size"] = (int(grid[0]) * kwargs["patch_size"], int(grid[1]) * kwargs["patch_size"])
    return kwargs


def convert_file(
    src: str,
    dst: str,
    to: str = "ours",
    arch: Optional[str] = None,
    window_size: Optional[int] = None,
    strict: bool = False,
) -> LoadReport:
    """Read ``src`` (any format), load it into a matching SwinBackbone, save ``dst`` as ``to``."""
    from ..model.backbone import SwinBackbone
    from ..model.v2 import SwinV2Backbone

    checkpoint = read_checkpoint(src)
    kwargs = infer_arch(checkpoint)
    v2 = kwargs.pop("swin_version", 1) == 2
    targets = V2_FROM_OURS if v2 else FROM_OURS
    if to not in targets:
        raise ValueError(
            f"to: expected one of {sorted(targets)} for a Swin V{2 if v2 else 1} checkpoint, got {to!r}"
        )
    if arch is not None:
        for key in ("embed_dims", "depths", "num_heads"):
            kwargs.pop(key)
        kwargs["arch"] = arch
    if window_size is not None:
        kwargs["window_size"] = window_size
    model = (SwinV2Backbone if v2 else SwinBackbone)(**kwargs, drop_path_rate=0.0)
    report = load_checkpoint(model, checkpoint, strict=strict, logger=None)
    report.source = src
    state = targets[to](model.state_dict())
    meta = dict(swin_backbone_format=to, source=os.path.basename(src), source_format=report.format, arch=kwargs)
    tmp = dst + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    torch.save({"state_dict": state, "meta": meta}, tmp)
    os.replace(tmp, dst)
    return report
