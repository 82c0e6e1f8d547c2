"""Regional compilation of the backbone (``compile=True``; docs/compiled-mode.md).

torch's regional-compilation recipe: the modules that hold the work are compiled (the repeated
blocks, the patch mergings, the patch embedding and the output norms); the planner, the window
layouts and the gathers between the stages stay eager. Each of these modules gets
``nn.Module.compile`` (its ``__call__`` compiled, hooks included, parameter names unchanged); they
share one code object, and with ``inline_inbuilt_nn_modules`` (torch >= 2.5's default) their
parameters are graph inputs, so modules of one class and equal shapes share one compiled graph.
The planner decides each stage's plan eagerly as a traced one (``plan_stages(...,
compiled_blocks=True)``), and the window layouts, bound to it, reach the compiled blocks as inputs.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional

import torch
from torch import nn

from ..torch_compat import compile_unsupported_reason, torch_version

#: torch with ``nn.Module.compile``.
MIN_TORCH = (2, 2)
#: Compiled graphs the compiled modules' code may hold (dynamo's default, 8, is per code object:
#: every compiled module shares ``nn.Module._call_impl``'s, and each class, stage width, batch 1
#: or more, eval and training is a graph of its own; past the limit dynamo would silently run the
#: modules eagerly).
RECOMPILE_LIMIT = 256


def check_can_compile() -> None:
    """``RuntimeError`` naming ``compile`` where this torch / Python cannot compile blocks."""
    if torch_version() < MIN_TORCH or not hasattr(nn.Module, "compile"):
        raise RuntimeError(f"compile: needs torch >= {'.'.join(map(str, MIN_TORCH))} (nn.Module.compile), "
                           f"this is torch {torch.__version__}; use compile=False")
    reason = compile_unsupported_reason()
    if reason is not None:
        raise RuntimeError(f"compile: torch.compile cannot run here ({reason}); use compile=False")


def region_modules(backbone: nn.Module) -> List[nn.Module]:
    """The modules ``compile=True`` compiles, in forward order: the patch embedding, each stage's
    blocks and patch merging, the output norms (``norm{i}``)."""
    regions: List[nn.Module] = [backbone.patch_embed]
    for stage in backbone.stages:
        regions.extend(stage.blocks)
        if stage.downsample is not None:
            regions.append(stage.downsample)
    return regions + [getattr(backbone, f"norm{i}") for i in backbone.out_indices]


def is_regional(options: Optional[Mapping[str, Any]]) -> bool:
    """Whether a backbone compiled with ``options`` compiles its regions (``None``: eager; ``regions=False``:
    the backbone is compiled whole, its forward traced as one graph, as ``torch.compile(backbone)``)."""
    return options is not None and options.get("regions", True) is not False


def compile_backbone(backbone: nn.Module, options: Mapping[str, Any]) -> int:
    """``module.compile(**options)`` for every module of :func:`region_modules`, or with
    ``options['regions']`` ``False`` ``torch.compile`` of the backbone's ``forward_static`` (its
    ``whole_graph``: static shapes with per-image sizes as a tensor); sets the backbone's
    ``regions_compiled`` and ``marks_cuda_graph_steps``; returns how many modules."""
    check_can_compile()
    backbone.regions_compiled = is_regional(options)
    backbone.marks_cuda_graph_steps = cuda_graph_steps(options)
    torch_options = {k: v for k, v in options.items() if k != "regions"}  # (regions is the backbone's own key)
    if backbone.regions_compiled:
        regions = region_modules(backbone)
        for module in regions:
            module.compile(**torch_options)
    else:
        # The class's function, called with the backbone: a deep copy (an EMA model) runs its own weights.
        regions = [backbone]
        backbone.whole_graph = torch.compile(type(backbone).forward_static, **torch_options)
    allow_recompiles()
    return len(regions)


def cuda_graph_steps(options: Optional[Mapping[str, Any]]) -> bool:
    """Whether a CUDA forward compiled with ``options`` replays CUDA graphs (inductor's
    ``mode='reduce-overhead'`` or ``'max-autotune'``, ``options={'triton.cudagraphs': True}``, or
    the ``'cudagraphs'`` backend; inductor's CPU code has none), so it marks a step.

    CUDA graph trees start a new step at each compiled call that no backward waits on: in
    inference each region would free the previous region's outputs, its own input (torch raises
    "accessing tensor output of CUDAGraphs that has been overwritten"). One forward is one step.
    """
    if options is None:
        return False
    backend = options.get("backend", "inductor")
    if backend == "cudagraphs":
        return True
    if backend != "inductor":
        return False
    import torch._inductor
    import torch._inductor.config

    flags = {"triton.cudagraphs": torch._inductor.config.triton.cudagraphs,
             **torch._inductor.list_mode_options(options.get("mode") or "default"), **(options.get("options") or {})}
    return bool(flags["triton.cudagraphs"])


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's per-code recompile limit to ``limit`` where it is lower (process-wide, as
    dynamo's config is; read while a block compiles)."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        setattr(config, name, limit)
