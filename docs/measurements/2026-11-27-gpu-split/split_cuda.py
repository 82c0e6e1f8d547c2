"""One-off GPU checks, H200, 2026-11-27 (not part of the product; results to $OUT/split.json).

1. Straddling-only masks (``split_masks``) and the 4-d shared bias on CUDA, fp32 with TF32 off:
   features and gradients with ``split_masks`` on against off, on a whole-window input, an input
   whose maps end mid-window, and a padded batch with ``valid_sizes`` (each image against the
   image alone too), eval and training.
2. Where a training step's time goes on the host: the time until the step's Python returns (its
   kernels launched, not waited for) against the synchronized step, ours and mmdet, bf16
   2x3x800x1344; and ours' host functions by own time (cProfile, one step).
"""
import cProfile
import io
import json
import os
import pstats
import time

import torch

from swin_backbone import ops
from swin_backbone.tools import benchmark
from swin_backbone.tools import benchmarking as B

dev = "cuda" if torch.cuda.is_available() else "cpu"
small = dev == "cpu"  # a smoke run here
OUT = os.environ.get("OUT", ".")
res = {"environment": B.environment()}
start = time.perf_counter()


def save():
    res["seconds"] = round(time.perf_counter() - start, 1)
    with open(f"{OUT}/split.json", "w") as f:
        json.dump(res, f, indent=1, default=str)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


models = B.build_pair(dev)
ours, mmdet = models["ours"], models.get("mmdet")


def run(x, split, train, **kw):
    ours.train(train)
    ours.zero_grad(set_to_none=True)
    with ops.override(split_masks=split), torch.set_grad_enabled(train):
        outs = ours(x, **kw)
        if train:
            sum(o.square().mean() for o in outs).backward()
    grads = [p.grad.clone() for p in ours.parameters() if p.grad is not None] if train else []
    ours.zero_grad(set_to_none=True)
    return [o.detach() for o in outs], grads


# ---- 1. split masks on CUDA
cases = {"whole_windows_2x3x224x224": (torch.randn(2, 3, 224, 224, device=dev), {}),
         "maps_end_mid_window_2x3x232x328": (torch.randn(2, 3, 232, 328, device=dev), {})}
xp, sizes = benchmark.padded_pair((200, 333), dev)
cases["padded_200x333+333x200_valid_sizes"] = (xp, dict(valid_sizes=sizes))
with B.tf32(False):
    for name, (x, kw) in cases.items():
        try:
            row = {}
            for train in (False, True):
                mode = "train" if train else "eval"
                off, on, again = run(x, False, train, **kw), run(x, True, train, **kw), run(x, False, train, **kw)
                row[mode] = dict(out_split_vs_off=max(rel(a, b) for a, b in zip(on[0], off[0])),
                                 out_off_vs_off=max(rel(a, b) for a, b in zip(again[0], off[0])))
                if train:
                    row[mode].update(grad_split_vs_off=max(rel(a, b) for a, b in zip(on[1], off[1])),
                                     grad_off_vs_off=max(rel(a, b) for a, b in zip(again[1], off[1])))
                if "valid_sizes" in kw:  # each image against itself alone, split on
                    errs, beyond = [], 0.0
                    for i, (h, w) in enumerate(sizes):
                        alone = run(x[i:i + 1, :, :h, :w], True, train)[0]
                        for got, ref in zip(on[0], alone):
                            fh, fw = ref.shape[-2:]
                            errs.append(rel(got[i, :, :fh, :fw], ref[0]))
                            rest = got[i].clone()
                            rest[:, :fh, :fw] = 0
                            beyond = max(beyond, rest.abs().max().item())
                    row[mode].update(split_vs_image_alone=max(errs), beyond_valid=beyond)
            res[f"split_{name}"] = row
        except Exception as err:
            res[f"split_{name}"] = f"error: {type(err).__name__}: {err}"
        print(name, res[f"split_{name}"], flush=True)
        save()

# ---- 2. host time of a training step
size = (64, 96) if small else (800, 1344)
x = torch.randn(2, 3, *size, device=dev)
row = {}


def host_and_step(fn):
    """``fn``'s host and whole time in ms: the 6th of 10 sorted calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    launched, total = [], []
    for _ in range(10):
        B.sync(dev)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        B.sync(dev)
        launched.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return sorted(launched)[5] * 1e3, sorted(total)[5] * 1e3


for name, model in (("ours", ours), ("mmdet", mmdet)):
    if model is None:
        continue
    model.train()
    host, step = host_and_step(B.train_step(model, x, torch.bfloat16))
    row[name] = dict(host_ms=host, step_ms=step)
    model.eval()  # (mmdet's returns None)
    host, step = host_and_step(B.eval_step(model, x[:1], torch.bfloat16))
    row[name].update(eval1_host_ms=host, eval1_ms=step)
    print(name, row[name], flush=True)
res["host_time_bf16"] = row
save()
ours.train()
step = B.train_step(ours, x, torch.bfloat16)
prof = cProfile.Profile()
prof.enable()
step()
B.sync(dev)
prof.disable()
buf = io.StringIO()
pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
res["cprofile_train_ours"] = buf.getvalue()
print(buf.getvalue()[:4000], flush=True)
save()
print(f"split_cuda done in {time.perf_counter() - start:.0f} s", flush=True)
