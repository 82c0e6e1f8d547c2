"""How a step is measured: wall time in interleaved rounds, FLOPs, the machine's dense matmul
rate, and which attention kernels one profiled step ran."""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import torch

from .steps import eval_step, train_step, with_switches


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleave(fns: Dict[str, Callable[[], None]], device: str, iters: int, warmup: int) -> Dict[str, List[float]]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return times


def count_flops(model, x) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(x)
    return counter.get_total_flops()


def matmul_step(device: str, n: int = 2048) -> Callable[[], None]:
    """Four dense fp32 ``n x n`` matmuls (``run.flops`` = ``8 n^3``): the attainable peak."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def run():
        for _ in range(4):
            a @ b

    run.flops = 4 * 2 * n**3  # type: ignore[attr-defined]
    return run


def sdpa_kernels(model, x, autocast_dtype, train: bool, changes: Optional[Dict[str, object]] = None,
                 **kwargs) -> dict:
    """Which attention one forward (``train``: one forward + backward) of ``model(x, **kwargs)``
    ran, under the planner overrides ``changes``, from one torch.profiler run:

    * ``kernels``: names of the SDPA / attention ops and kernels;
    * ``sdpa_calls``: SDPA calls (forward backend ops ``aten::_scaled_dot_product_*``: one per
      call, also where a compiled graph calls a backend directly);
    * ``triton_window_attention_launches``: GPU launches of the fused Triton window-attention
      kernel; ``inductor_triton_launches``: of inductor's Triton kernels (``triton_*``);
    * ``constant_pad_nd`` / ``copy_``: those ops in the whole step, and ``*_in_sdpa``: inside
      SDPA calls (the fused CUDA kernels copy a mask whose non-last strides are not multiples
      of 8 on every call; nested ops count too: a pad's own copy is also a copy).
    """
    from torch.autograd import DeviceType
    from torch.profiler import profile

    step = with_switches((train_step if train else eval_step)(model, x, autocast_dtype, **kwargs), changes or {})
    with profile() as prof:
        step()
        sync(x.device.type)
    events = prof.events()
    counts = {"constant_pad_nd": 0, "copy_": 0, "constant_pad_nd_in_sdpa": 0, "copy_in_sdpa": 0}
    for e in events:
        if e.name in ("aten::constant_pad_nd", "aten::copy_"):
            op = e.name[len("aten::"):]
            counts[op] += 1
            parent = e.cpu_parent
            while parent is not None and "scaled_dot_product" not in parent.name:
                parent = parent.cpu_parent
            counts[op.rstrip("_") + "_in_sdpa"] += parent is not None
    on_device = [e.name for e in events if e.device_type != DeviceType.CPU]
    names = {e.key for e in prof.key_averages()}
    return {
        "step": "forward+backward" if train else "forward",
        "kernels": sorted(n for n in names if "scaled_dot_product" in n or "attention" in n.lower()
                          or n.startswith(("fmha", "flash"))),
        "sdpa_calls": sum(e.name.startswith("aten::_scaled_dot_product_") and not e.name.endswith("_backward")
                          for e in events),
        "triton_window_attention_launches": sum("_window_attention_kernel" in n for n in on_device),
        "inductor_triton_launches": sum(n.startswith("triton_") for n in on_device),
        **counts,
    }
