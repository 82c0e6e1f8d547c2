"""One-off GPU measurement (H200, 2026-11-28): CUDA graphs (mode='reduce-overhead', static
shapes) where a step waits on the host, after the fix that makes a forward of CUDA-graphed regions
one CUDA-graph step: eval bf16 1x3x800x1344, then training bf16 2x3x512x512 (the ADE20K recipe's
per-GPU batch and crop, one fixed size), each: mmdet eager, mmdet compiled whole, ours eager, ours
compile=dict(mode='reduce-overhead', dynamic=False); outputs of ours compiled against eager; peak
memory growth of one training step. Writes $OUT/cg2.json after every row."""
import argparse
import json
import os
import time

import torch

from swin_backbone.tools import benchmark
from swin_backbone.tools import benchmarking as B

START = time.perf_counter()
OUT = os.environ.get("OUT", ".")
DEV = os.environ.get("DEV", "cuda")
EVAL = tuple(int(s) for s in os.environ.get("EVAL", "800,1344").split(","))
TRAIN = tuple(int(s) for s in os.environ.get("TRAIN", "512,512").split(","))
RO = dict(mode="reduce-overhead", dynamic=False)
res = {"environment": B.environment()}
bf16 = torch.bfloat16
args = argparse.Namespace(iters=int(os.environ.get("ITERS", "7")), warmup=2)


def save():
    res["seconds"] = round(time.perf_counter() - START, 1)
    with open(f"{OUT}/cg2.json", "w") as f:
        json.dump(res, f, indent=1)


def main():
    models = B.build_pair(DEV)
    ours, mmdet = models["ours"], models["mmdet"]
    ours_ro = B.regional_model(ours, **RO)
    mmdet_ro = B.compile_model(mmdet, **RO)
    variants = {"mmdet": mmdet, "mmdet_compiled": mmdet_ro, "ours": ours, "ours_regional": ours_ro}
    for kind, batch, size, step in (("eval", 1, EVAL, B.eval_step), ("train", 2, TRAIN, B.train_step)):
        x = torch.randn(batch, 3, *size, device=DEV)
        for m in variants.values():
            m.train(kind == "train")
        fns = {k: step(m, x, bf16) for k, m in variants.items()}
        fns["mmdet_compiled"] = B.marked_step(fns["mmdet_compiled"])
        skips = benchmark.cudagraph_skips()
        key = f"reduce_overhead_{kind}_bf16_{batch}x3x{size[0]}x{size[1]}"
        row = benchmark.compiled_row(key, fns, DEV, args)
        row["cudagraph_skips"] = benchmark.cudagraph_skips() - skips
        # ours compiled against eager: outputs (same weights, same input)
        mode = torch.enable_grad() if kind == "train" else torch.inference_mode()
        with torch.autocast(DEV, dtype=bf16), mode:
            a = [o.float().clone() for o in ours(x)]
            b = [o.float().clone() for o in ours_ro(x)]
        row["ours_regional_vs_eager_max_rel"] = max(((p - q).abs().max() / p.abs().max()).item() for p, q in zip(a, b))
        del a, b
        if kind == "train" and DEV == "cuda":
            row["step_peak_growth_bytes"] = {k: B.step_peak_cuda(fn) for k, fn in fns.items()}
        res[key] = row
        save()
        print(key, row["median_s"], row["first_call_s"], flush=True)
    save()
    print("done", res["seconds"], flush=True)


if __name__ == "__main__":
    main()
