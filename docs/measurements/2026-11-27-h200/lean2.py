"""One-off GPU measurement, H200, 2026-11-27, second device call (results to $OUT/lean2.json).

1. Where lean saves cost time on CUDA: training 2x3xHxW bf16 and fp32, interleaved: mmdet, ours
   (lean off), lean (all), lean with GELU only (norm outputs kept), lean with the norm rebuilt by
   torch's own layer_norm kernel (eps 1e-5, one kernel); time and peak memory of each.
2. The compiled mode on CUDA: ours with compile=True (blocks compiled, dynamic) against ours eager
   and mmdet eager, eval bf16 8x and training bf16 2x, first-call (compile) times; then
   torch.compile of mmdet (dynamic=False) eval 8x, as time allows.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from swin_backbone import ops
from swin_backbone.ops import regions
from swin_backbone.tools import benchmarking as B

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--size", type=int, nargs=2, default=(800, 1344))
p.add_argument("--iters", type=int, default=15)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--deadline", type=float, default=280, help="seconds: no compile row starts after")
args = p.parse_args()
dev = args.device
OUT = os.environ.get("OUT", ".")
res = {"environment": B.environment(), "args": vars(args)}
start = time.perf_counter()


def save():
    res["seconds"] = round(time.perf_counter() - start, 1)
    with open(f"{OUT}/lean2.json", "w") as f:
        json.dump(res, f, indent=1, default=str)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def peak(fn):
    sync()
    base = 0
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20 if dev == "cuda" else 0.0


REAL_REBUILD = regions._rebuild


def kernel_rebuild(node, dtype):
    if type(node).__name__ == regions._LAYER_NORM:
        return F.layer_norm(node._saved_input, node._saved_normalized_shape, node._saved_weight, node._saved_bias, 1e-5)
    return REAL_REBUILD(node, dtype)


def variant(fn, lean, norms="rebuild"):
    def run():
        ln, rb = regions._LAYER_NORM, regions._rebuild
        if norms == "keep":
            regions._LAYER_NORM = "(kept)"
        elif norms == "kernel":
            regions._rebuild = kernel_rebuild
        try:
            with ops.override(save_memory=lean):
                fn()
        finally:
            regions._LAYER_NORM, regions._rebuild = ln, rb
    return run


models = B.build_pair(dev)
ours, mmdet = models["ours"], models.get("mmdet")
xt = torch.randn(2, 3, *args.size, device=dev)

# ---- 1. lean variants
for dtype in (torch.bfloat16, None):
    tag = B.dtype_tag(dtype)
    for m in models.values():
        m.train()
    fns = {"mmdet": B.train_step(mmdet, xt, dtype)} if mmdet is not None else {}
    step = B.train_step(ours, xt, dtype)
    fns.update(ours=variant(step, False), lean=variant(step, True), lean_gelu_only=variant(step, True, "keep"),
               lean_norm_kernel=variant(step, True, "kernel"))
    times = B.interleave(fns, dev, args.iters, args.warmup)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    row = {"median_ms": med,
           "cost_over_ours": {k: statistics.median(a / b for a, b in zip(times[k], times["ours"])) - 1 for k in fns},
           "peak_MiB": {k: peak(fn) for k, fn in fns.items()}}
    if mmdet is not None:
        row["speedup_over_mmdet"] = {k: med["mmdet"] / v for k, v in med.items()}
        row["memory_over_mmdet"] = {k: v / max(row["peak_MiB"]["mmdet"], 1e-9) for k, v in row["peak_MiB"].items()}
    res[f"lean_train_{tag}"] = row
    print(tag, row, flush=True)
    save()

# ---- 2. compiled mode
bf16 = torch.bfloat16
x8 = torch.randn(8, 3, *args.size, device=dev)
x2 = xt
regional = B.regional_model(ours)
for kind, x, stepf in (("eval", x8, B.eval_step), ("train", x2, B.train_step)):
    if time.perf_counter() - start > args.deadline:
        res.setdefault("skipped", []).append(f"compiled {kind}")
        continue
    for m in (ours, regional, mmdet):
        if m is not None:
            m.train(kind == "train")
    fns = {"ours": stepf(ours, x, bf16), "ours_regional": stepf(regional, x, bf16)}
    if mmdet is not None:
        fns["mmdet"] = stepf(mmdet, x, bf16)
    t0 = time.perf_counter()
    first = {"ours_regional": B.timed(fns["ours_regional"], dev)}
    times = B.interleave(fns, dev, args.iters, args.warmup)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    res[f"compiled_{kind}_bf16_{x.shape[0]}x"] = {"median_ms": med, "first_call_s": first,
                                                  "speedup_over_mmdet": {k: med.get("mmdet", float("nan")) / v
                                                                         for k, v in med.items()}}
    print(kind, res[f"compiled_{kind}_bf16_{x.shape[0]}x"], flush=True)
    save()

if mmdet is not None and time.perf_counter() - start < args.deadline:
    mmdet.eval()
    compiled = B.compile_model(mmdet, dynamic=False)
    fns = {"mmdet_compiled": B.eval_step(compiled, x8, bf16), "mmdet": B.eval_step(mmdet, x8, bf16)}
    first = {"mmdet_compiled": B.timed(fns["mmdet_compiled"], dev)}
    res["first_call_s_mmdet_compiled_eval"] = first
    save()
    times = B.interleave(fns, dev, args.iters, args.warmup)
    res["compiled_mmdet_eval_bf16_8x"] = {"median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                                          "first_call_s": first}
    print("mmdet compiled", res["compiled_mmdet_eval_bf16_8x"], flush=True)
    save()
print(f"lean2 done in {time.perf_counter() - start:.0f} s", flush=True)
