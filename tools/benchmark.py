#!/usr/bin/env python
"""Speed and memory of SwinBackbone against mmdet 3.3's SwinTransformer, same weights, same run.

Measures (interleaved A B A B ... after warm-up; medians, and speedups as the median of the
per-round ratios):
  1. forward, eval, 1x3x800x1216 under inference_mode;
  2. forward + backward, train mode, 2x3x512x512;
  3. peak memory of (2): CPU: peak RSS growth (kernel high-water mark, reset first) in a
     fresh subprocess per model;
     CUDA: torch.cuda.max_memory_allocated;
plus the backbone's FLOPs (torch.utils.flop_counter; 1 multiply-add = 2 FLOPs) and the achieved
GFLOP/s of (1) beside this machine's dense fp32 matmul GFLOP/s (the physical ceiling), measured
in the same rounds as (1).
On CUDA it also runs bf16 autocast at 800x1333, batch 1 and 8.

    python tools/benchmark.py [--iters 9] [--json out.json] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swin_backbone import SwinBackbone, load_checkpoint  # noqa: E402

ARCH = dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7)


def build_pair(device: str, seed: int = 0):
    """mmdet's SwinTransformer and ours (Swin-T) with identical weights."""
    from mmdet.models.backbones import SwinTransformer

    torch.manual_seed(seed)
    ref = SwinTransformer(**ARCH, drop_path_rate=0.0)
    ref.init_weights()
    ours = SwinBackbone(arch=None, **ARCH, drop_path_rate=0.0)
    load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    return {"mmdet": ref.to(device), "ours": ours.to(device)}


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


def eval_step(model, x, autocast_dtype=None):
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        with torch.inference_mode(), ctx:
            model(x)

    return run


def train_step(model, x, autocast_dtype=None):
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        with ctx:
            outs = model(x)
        loss = sum(o.float().mean() for o in outs)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


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


def memory_child(name: str, device: str, batch: int, size: int) -> None:
    """Run in a fresh process: peak memory of one fwd+bwd beyond the model and input."""
    models = build_pair(device)
    model = models[name]
    model.train()  # (mmdet's train() returns None: no chaining)
    del models
    x = torch.randn(batch, 3, size, size, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        train_step(model, x)()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        import gc

        gc.collect()
        base = _reset_peak_rss()
        train_step(model, x)()
        peak = _peak_rss() - base
    print(json.dumps({"peak_bytes": int(peak)}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0) and return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def _peak_rss() -> int:
    return _status_kb("VmHWM")


def peak_memory(name: str, device: str, batch: int, size: int) -> int:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", name, "--device", device,
           "--batch", str(batch), "--train-size", str(size)]
    # Large blocks straight from / back to the OS (mmap), so RSS follows live tensors instead
    # of glibc's retained free memory.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


def summarize(label: str, times: Dict[str, List[float]]) -> dict:
    """Medians, and the speedup as the median of per-round ratios: each round runs both models
    back to back, so a ratio within a round is immune to the machine's drift between rounds."""
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = statistics.median(m / o for m, o in zip(times["mmdet"], times["ours"]))
    print(f"{label}: ours {med['ours'] * 1e3:.0f} ms, mmdet {med['mmdet'] * 1e3:.0f} ms, speedup {ratio:.2f}x")
    return {"ours_s": med["ours"], "mmdet_s": med["mmdet"], "speedup": ratio, "samples": times}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--eval-size", type=int, nargs=2, default=(800, 1216), metavar=("H", "W"))
    parser.add_argument("--train-size", type=int, default=512, help="train images are 2 x 3 x S x S")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.device, args.batch, args.train_size)
        return {}

    device = args.device
    results: dict = {"device": device, "threads": torch.get_num_threads(), "torch": torch.__version__}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    print(f"device {device}" + (f" ({results['gpu']})" if device == "cuda" else f", {torch.get_num_threads()} threads"))
    models = build_pair(device)

    eh, ew = args.eval_size
    ts = args.train_size
    x_eval = torch.randn(1, 3, eh, ew, device=device)
    for m in models.values():
        m.eval()
    # The matmul ceiling is measured in the same rounds, so it sees the same machine state.
    matmul = matmul_step(device)
    times = interleave({**{k: eval_step(m, x_eval) for k, m in models.items()}, "matmul": matmul},
                       device, args.iters, args.warmup)
    matmul_times = times.pop("matmul")
    eval_times = times
    results["forward_eval"] = summarize(f"forward eval 1x3x{eh}x{ew}", eval_times)

    x_train = torch.randn(2, 3, ts, ts, device=device)
    for m in models.values():
        m.train()
    times = interleave({k: train_step(m, x_train) for k, m in models.items()}, device, args.iters, args.warmup)
    results["forward_backward"] = summarize(f"forward+backward train 2x3x{ts}x{ts}", times)

    if not args.skip_memory:
        mem = {k: peak_memory(k, device, 2, ts) for k in models}
        ratio = mem["ours"] / mem["mmdet"]
        print(f"peak memory fwd+bwd 2x3x{ts}x{ts}: ours {mem['ours'] / 2**20:.0f} MiB, "
              f"mmdet {mem['mmdet'] / 2**20:.0f} MiB, ratio {ratio:.2f}x")
        results["peak_memory"] = {"ours_bytes": mem["ours"], "mmdet_bytes": mem["mmdet"], "ratio": ratio}

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

    if device == "cuda":
        for batch in (1, 8):
            x = torch.randn(batch, 3, 800, 1333, device=device)
            for m in models.values():
                m.eval()
            times = interleave({k: eval_step(m, x, torch.bfloat16) for k, m in models.items()}, device, args.iters, args.warmup)
            results[f"forward_eval_bf16_{batch}x3x800x1333"] = summarize(f"forward eval bf16 {batch}x3x800x1333", times)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
