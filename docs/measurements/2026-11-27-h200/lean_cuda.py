"""One-off GPU checks, H200, 2026-11-27 (not part of the product; results to $OUT/lean.json).

1. Lean saves on CUDA: outputs and gradients with ``save_memory`` forced on against plain
   autograd (fp32 TF32 off, and bf16 autocast), with plain-vs-plain as the noise floor.
2. Training step 2x3xHxW, bf16 autocast and fp32: mmdet, ours (CUDA default), ours with lean
   saves: interleaved rounds (medians), and each one's peak memory growth of one step.
3. Swin V2 tiny (window 8) training bf16: lean saves on / off, time and peak memory.
4. ``valid_sizes`` on CUDA: each image of a padded batch equals the image alone (fp32, TF32 off),
   eval and a training forward, lean saves on.
"""
import argparse
import json
import os
import statistics
import time

import torch

from swin_backbone import ops
from swin_backbone.tools import benchmark
from swin_backbone.tools import benchmarking as B

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--size", type=int, nargs=2, default=(800, 1344))
p.add_argument("--check-size", type=int, nargs=2, default=(232, 328))
p.add_argument("--padded-size", type=int, nargs=2, default=(200, 333))
p.add_argument("--iters", type=int, default=15)
p.add_argument("--warmup", type=int, default=3)
args = p.parse_args()
dev = args.device
OUT = os.environ.get("OUT", ".")
res = {"environment": B.environment(), "args": vars(args)}
start = time.perf_counter()


def save():
    res["seconds"] = round(time.perf_counter() - start, 1)
    with open(f"{OUT}/lean.json", "w") as f:
        json.dump(res, f, indent=1, default=str)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def worst(u, v):
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(u, v))


def equal(u, v):
    return [sum(torch.equal(a, b) for a, b in zip(u, v)), len(u)]


models = B.build_pair(dev)
ours, mmdet = models["ours"], models.get("mmdet")

# ---- 1. gradients
x = torch.randn(2, 3, *args.check_size, device=dev)


def grads(model, save_memory, bf16):
    model.train()
    model.zero_grad(set_to_none=True)
    with ops.override(save_memory=save_memory), torch.autocast(dev, torch.bfloat16, enabled=bf16):
        outs = model(x)
    sum(o.float().square().mean() for o in outs).backward()
    g = [q.grad.float().clone() for q in model.parameters() if q.grad is not None]
    model.zero_grad(set_to_none=True)
    return [o.detach().float() for o in outs], g


for bf16 in (False, True):
    tag = "bf16" if bf16 else "fp32"
    try:
        with B.tf32(False):
            lean, plain, again = grads(ours, True, bf16), grads(ours, False, bf16), grads(ours, False, bf16)
            d64 = None
            if not bf16:  # an fp64 reference: how close is each to the exact gradient
                ref = ours.double()
                x64 = x
                x = x.double()
                exact = grads(ref, False, False)
                x = x64
                ours.float()
                d64 = dict(lean=worst(lean[1], exact[1]), plain=worst(plain[1], exact[1]))
        res[f"grads_{tag}"] = dict(out_lean_vs_plain=worst(lean[0], plain[0]), grad_lean_vs_plain=worst(lean[1], plain[1]),
                                   grad_plain_vs_plain=worst(again[1], plain[1]), grads_equal=equal(lean[1], plain[1]),
                                   plain_equal=equal(again[1], plain[1]), vs_fp64=d64)
    except Exception as err:  # keep going: the timing rows matter as much
        res[f"grads_{tag}"] = f"error: {type(err).__name__}: {err}"
    print(tag, res[f"grads_{tag}"], flush=True)
    save()

# ---- 2. training step: time and peak memory
xt = torch.randn(2, 3, *args.size, device=dev)


def peak(fn):
    sync()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() - base if dev == "cuda" else 0


for dtype in (torch.bfloat16, None):
    tag = B.dtype_tag(dtype)
    fns = {}
    for m in models.values():
        m.train()  # (mmdet's train() returns None)
    if mmdet is not None:
        fns["mmdet"] = B.train_step(mmdet, xt, dtype)
    fns["ours"] = B.train_step(ours, xt, dtype)
    fns["ours_lean"] = B.with_switches(B.train_step(ours, xt, dtype), dict(save_memory=True))
    times = B.interleave(fns, dev, args.iters, args.warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"median_ms": {k: v * 1e3 for k, v in med.items()},
           "lean_cost": statistics.median(a / b for a, b in zip(times["ours_lean"], times["ours"])) - 1,
           "peak_MiB": {k: peak(fn) / 2**20 for k, fn in fns.items()}, "samples": times}
    if mmdet is not None:
        row["speedup_over_mmdet"] = {k: med["mmdet"] / med[k] for k in ("ours", "ours_lean")}
        row["memory_over_mmdet"] = {k: row["peak_MiB"][k] / max(row["peak_MiB"]["mmdet"], 1e-9)
                                    for k in ("ours", "ours_lean")}
    res[f"train_{tag}_2x3x{args.size[0]}x{args.size[1]}"] = row
    print(tag, {k: v for k, v in row.items() if k != "samples"}, flush=True)
    save()

# ---- 3. V2 training bf16
try:
    v2 = B.build_v2(dev, args.size, peers=False)["ours"]
    v2.train()
    fns = {"v2": B.train_step(v2, xt, torch.bfloat16),
           "v2_lean": B.with_switches(B.train_step(v2, xt, torch.bfloat16), dict(save_memory=True))}
    times = B.interleave(fns, dev, max(5, args.iters // 2), args.warmup)
    res["v2_train_bf16"] = {"median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
                            "lean_cost": statistics.median(a / b for a, b in zip(times["v2_lean"], times["v2"])) - 1,
                            "peak_MiB": {k: peak(fn) / 2**20 for k, fn in fns.items()}}
    del v2
except Exception as err:
    res["v2_train_bf16"] = f"error: {type(err).__name__}: {err}"
print("v2", res["v2_train_bf16"], flush=True)
save()

# ---- 4. valid_sizes image-exact on CUDA
try:
    xp, sizes = benchmark.padded_pair(args.padded_size, dev)
    worst_rel = {}
    with B.tf32(False):
        for mode in ("eval", "train"):
            ours.train(mode == "train")  # (returns the module; not relied on)
            ctx = torch.no_grad() if mode == "eval" else torch.enable_grad()
            with ctx, ops.override(save_memory=True):
                outs = ours(xp, valid_sizes=sizes)
                alone = [ours(xp[i:i + 1, :, :h, :w]) for i, (h, w) in enumerate(sizes)]
            errs, beyond = [], 0.0
            for i, image_outs in enumerate(alone):
                for got, ref in zip(outs, image_outs):
                    h, w = ref.shape[-2:]
                    errs.append(((got[i, :, :h, :w] - ref[0]).abs().max() / ref.abs().max()).item())
                    rest = got[i].detach().clone()
                    rest[:, :h, :w] = 0
                    beyond = max(beyond, rest.abs().max().item())
            worst_rel[mode] = dict(max_rel_err=max(errs), max_beyond_valid=beyond)
    res["valid_sizes_exact"] = worst_rel
except Exception as err:
    res["valid_sizes_exact"] = f"error: {type(err).__name__}: {err}"
print("valid_sizes", res["valid_sizes_exact"], flush=True)
save()
print(f"lean_cuda done in {time.perf_counter() - start:.0f} s", flush=True)
