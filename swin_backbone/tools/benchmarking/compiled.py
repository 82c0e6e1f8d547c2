"""The ``--compile`` rows: ``torch.compile`` (dynamic) of mmdet, ours and ours with the opt-in
fused Triton kernel, and CUDA graphs (``mode="reduce-overhead"``) against eager."""
from __future__ import annotations

import copy
from typing import Dict, Sequence

import torch

from . import steps
from .measure import interleave, sdpa_kernels
from .report import summarize
from .steps import eval_step, train_step, with_switches


def _allow_recompiles(limit: int = 32) -> None:
    """Raise dynamo's recompile limit per function (default 8): :func:`run_compiled` traces
    SwinBackbone's forward in 5 variants (eval / training, with / without the Triton kernel,
    CUDA graphs) besides any a caller compiled; past the limit dynamo would run it eagerly."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def _cudagraph_skips() -> int:
    """How often inductor has so far declined to use CUDA graphs for a compiled graph."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def run_compiled(args, results: dict, models: Dict[str, torch.nn.Module], size: Sequence[int]) -> None:
    """``--compile`` rows of ``models`` (mmdet, ours) at ``size``, bf16 autocast:

    * ``compiled_eval_bf16_8x3x{H}x{W}``, ``compiled_train_bf16_2x3x{H}x{W}``: ``torch.compile``
      (dynamic) of mmdet, ours (SDPA) and ``ours_triton`` (a copy of ours, same weights, with
      ``attention='triton'``: the opt-in fused kernel as a custom operator in the graph), one
      step each per round (warmup + iters rounds);
    * ``sdpa_kernels["compiled_{eval,train}_bf16[_triton]"]``: which attention ran in both;
    * ``compiled_reduce_overhead_eval_bf16_1x3x{H}x{W}``: eval 1x with
      ``mode="reduce-overhead"`` (CUDA graphs, one input size) of mmdet and ours, and both
      eager (``*_eager``), in the same rounds; ``cudagraph_skips``: compiled graphs that
      inductor ran without CUDA graphs.
    """
    device = args.device
    h, w = size
    bf16 = torch.bfloat16
    _allow_recompiles()
    # The opt-in fused kernel: a copy of ours with attention='triton' (a module of its own: it
    # shares no guards / caches with "ours").
    twin = copy.deepcopy(models["ours"])
    twin.attention = "triton"
    compiled = {k: steps.compile_model(m, dynamic=True) for k, m in {**models, "ours_triton": twin}.items()}
    changes: Dict[str, Dict[str, object]] = {k: {} for k in compiled}
    x8 = torch.randn(8, 3, h, w, device=device)
    x2 = torch.randn(2, 3, h, w, device=device)
    for m in compiled.values():
        m.eval()
    times = interleave({k: with_switches(eval_step(m, x8, bf16), changes[k]) for k, m in compiled.items()}, device,
                       args.iters, args.warmup)
    results[f"compiled_eval_bf16_8x3x{h}x{w}"] = summarize(f"torch.compile eval bf16 8x3x{h}x{w}", times)
    for m in compiled.values():
        m.train()
    times = interleave({k: with_switches(train_step(m, x2, bf16), changes[k]) for k, m in compiled.items()}, device,
                       args.iters, args.warmup)
    results[f"compiled_train_bf16_2x3x{h}x{w}"] = summarize(f"torch.compile train bf16 2x3x{h}x{w}", times)
    kernels = results.setdefault("sdpa_kernels", {})  # (no eager rows with --compile only)
    for name, suffix in (("ours", ""), ("ours_triton", "_triton")):  # the timed shapes: no recompiles
        m = compiled[name]
        kernels[f"compiled_eval_bf16{suffix}"] = sdpa_kernels(m.eval(), x8, bf16, False, changes[name])
        kernels[f"compiled_train_bf16{suffix}"] = sdpa_kernels(m.train(), x2, bf16, True, changes[name])
    # Batch-1 eval is launch-bound on a GPU: CUDA graphs replay a whole forward in one launch.
    graphed = {k: steps.compile_model(m, mode="reduce-overhead", dynamic=False) for k, m in models.items()}
    for m in models.values():
        m.eval()
    x1 = torch.randn(1, 3, h, w, device=device)
    fns = {k: eval_step(m, x1, bf16) for k, m in graphed.items()}
    fns.update({f"{k}_eager": eval_step(m, x1, bf16) for k, m in models.items()})
    skips = _cudagraph_skips()
    # CUDA graph trees record on a call after the compiling one and replay from the next: 3 warm-up rounds at least.
    times = interleave(fns, device, args.iters, max(args.warmup, 3))
    row = summarize(f"torch.compile reduce-overhead eval bf16 1x3x{h}x{w}", times)
    results[f"compiled_reduce_overhead_eval_bf16_1x3x{h}x{w}"] = {**row, "cudagraph_skips": _cudagraph_skips() - skips}
    torch._dynamo.reset()  # frees the compiled graphs and CUDA graph pools before the rows that follow
