"""The CPU run of ``swin-benchmark`` (the default without CUDA)."""
from __future__ import annotations

import statistics

import torch

from . import builders, memory
from .measure import count_flops, interleave, matmul_step
from .report import memory_row, summarize
from .rows import run_v2, upernet_step, valid_sizes_overhead
from .steps import eval_step, train_step


def run_cpu(args, results: dict) -> None:
    device = "cpu"
    models = builders.build_pair(device)
    eh, ew = args.eval_size
    ts = args.train_size
    x_eval = torch.randn(1, 3, eh, ew, device=device)
    for m in models.values():
        m.eval()
    peers = {} if args.no_peers else builders.build_peers(device, (eh, ew))
    # The matmul ceiling is measured in the same rounds, so it sees the same machine state.
    matmul = matmul_step(device)
    fns = {**{k: eval_step(m, x_eval) for k, m in {**models, **peers}.items()}, "matmul": matmul}
    times = interleave(fns, device, args.iters, args.warmup)
    matmul_times = times.pop("matmul")
    eval_times = times
    results["forward_eval"] = summarize(f"forward eval 1x3x{eh}x{ew}", eval_times)

    x_train = torch.randn(2, 3, ts, ts, device=device)
    for m in models.values():
        m.train()
    times = interleave({k: train_step(m, x_train) for k, m in models.items()}, device, args.iters, args.warmup)
    results["forward_backward"] = summarize(f"forward+backward train 2x3x{ts}x{ts}", times)

    if not args.skip_memory:
        mem = {k: memory.peak_memory(k, device, 2, (ts, ts)) for k in models}
        results["peak_memory"] = memory_row(f"peak memory fwd+bwd 2x3x{ts}x{ts}", mem)

    models["ours"].eval()
    flops = count_flops(models["ours"], x_eval)
    achieved = [flops / t / 1e9 for t in eval_times["ours"]]
    ceiling = [matmul.flops / t / 1e9 for t in matmul_times]  # type: ignore[attr-defined]
    fraction = statistics.median(a / c for a, c in zip(achieved, ceiling))
    print(f"FLOPs 1x3x{eh}x{ew}: {flops / 1e9:.1f} GFLOP; achieved {statistics.median(achieved):.0f} GFLOP/s "
          f"= {100 * fraction:.0f}% of the dense fp32 matmul ceiling ({statistics.median(ceiling):.0f} GFLOP/s, "
          f"2048x2048 matmuls measured in the same rounds)")
    results["flops"] = {"gflop": flops / 1e9, "achieved_gflops": statistics.median(achieved),
                        "matmul_gflops": statistics.median(ceiling), "fraction_of_ceiling": fraction}
    run_valid_sizes_overhead(models["ours"], args, results)
    if args.upernet:
        results["upernet_train_bf16"] = upernet_step(args.upernet, device, args.iters, args.warmup, args.upernet_size)


def run_cpu_v2(args, results: dict) -> None:
    """The Swin V2 rows on the CPU: eval 1x3xHxW and training 2x3xSxS in fp32 (the V1 rows' sizes)."""
    ts = args.train_size
    run_v2(args, results, "cpu", args.eval_size, (ts, ts), evals=[(1, None)], trains=[None])


def run_valid_sizes_overhead(model: torch.nn.Module, args, results: dict) -> None:
    """CPU: the eval cost of per-image valid sizes at the eval size (:func:`valid_sizes_overhead`)."""
    device = next(model.parameters()).device.type
    results["valid_sizes_overhead"] = valid_sizes_overhead(model, args.eval_size, device, args.iters, args.warmup)
