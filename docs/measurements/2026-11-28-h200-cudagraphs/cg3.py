"""One-off GPU measurement (H200, 2026-11-28): the whole of ours compiled with CUDA graphs
(``torch.compile(backbone, mode='reduce-overhead', dynamic=False)``, as a user compiles a model
whole, e.g. mmengine's Runner(compile=...)), training bf16 2x3x512x512, beside ours and mmdet
eager; its first (compiling) call, dynamo's graph count and graph breaks. Writes $OUT/cg3.json."""
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
TRAIN = tuple(int(s) for s in os.environ.get("TRAIN", "512,512").split(","))
res = {"environment": B.environment()}
args = argparse.Namespace(iters=int(os.environ.get("ITERS", "7")), warmup=2)


def save():
    res["seconds"] = round(time.perf_counter() - START, 1)
    with open(f"{OUT}/cg3.json", "w") as f:
        json.dump(res, f, indent=1)


def main():
    from torch._dynamo.utils import counters

    models = B.build_pair(DEV)
    ours, mmdet = models["ours"], models["mmdet"]
    whole = B.compile_model(ours, mode="reduce-overhead", dynamic=False)
    x = torch.randn(2, 3, *TRAIN, device=DEV)
    for m in (ours, mmdet):
        m.train()
    fns = {"mmdet": B.train_step(mmdet, x, torch.bfloat16), "ours": B.train_step(ours, x, torch.bfloat16),
           "ours_whole_compiled": B.train_step(whole, x, torch.bfloat16)}
    res["first_call_s"] = {"ours_whole_compiled": B.timed(fns["ours_whole_compiled"], DEV)}
    res["unique_graphs"] = int(counters["stats"]["unique_graphs"])
    res["graph_breaks"] = {str(k): v for k, v in counters["graph_break"].items()}
    res["cudagraph_skips"] = benchmark.cudagraph_skips()
    save()
    print(res, flush=True)
    times = B.interleave(fns, DEV, args.iters, args.warmup)
    res[f"train_bf16_2x3x{TRAIN[0]}x{TRAIN[1]}"] = B.summarize(f"train bf16 2x3x{TRAIN[0]}x{TRAIN[1]}", times)
    save()
    print("done", res["seconds"], flush=True)


if __name__ == "__main__":
    main()
