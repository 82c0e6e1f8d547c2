"""Regional compilation of the backbone (``compile=True``; docs/compiled-mode.md).

torch's regional-compilation recipe: the repeated blocks are compiled, the rest of the forward
(planner, window layouts, patch embedding and merging, output norms) stays eager. Each block gets
``nn.Module.compile`` (its ``__call__`` compiled, hooks included, parameter names unchanged); the
blocks of a class share one code object, and with ``inline_inbuilt_nn_modules`` (torch >= 2.5's
default) their parameters are graph inputs, so blocks of equal shapes share one compiled graph.
The planner decides each stage's plan eagerly as a traced one (``plan_forward(...,
compiled_blocks=True)``), and the window layouts reach the compiled blocks as inputs.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..torch_compat import compile_unsupported_reason, torch_version

#: torch with ``nn.Module.compile``.
MIN_TORCH = (2, 2)
#: Compiled graphs a block's code may hold (dynamo's default, 8, is per code object: the blocks
#: of every stage share it, and each stage's widths, batch 1 or more, eval and training are
#: graphs of their own; past the limit dynamo would silently run the blocks eagerly).
RECOMPILE_LIMIT = 128


def check_can_compile() -> None:
    """``RuntimeError`` naming ``compile`` where this torch / Python cannot compile blocks."""
    if torch_version() < MIN_TORCH or not hasattr(nn.Module, "compile"):
        raise RuntimeError(f"compile: needs torch >= {'.'.join(map(str, MIN_TORCH))} (nn.Module.compile), "
                           f"this is torch {torch.__version__}; use compile=False")
    reason = compile_unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"compile: torch.compile cannot run here ({reason}); use compile=False")


def compile_blocks(stages: nn.ModuleList, options: Mapping[str, Any]) -> int:
    """``block.compile(**options)`` for every block of ``stages``; returns how many."""
    check_can_compile()
    count = 0
    for stage in stages:
        for block in stage.blocks:
            block.compile(**options)
            count += 1
    allow_recompiles()
    return count


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's per-code recompile limit to ``limit`` where it is lower (process-wide, as
    dynamo's config is; read while a block compiles)."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        setattr(config, name, limit)
