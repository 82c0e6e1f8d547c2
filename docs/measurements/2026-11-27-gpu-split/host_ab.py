"""One-off A/B of the host-time changes, H200, 2026-11-27 (not part of the product).

Run once per code version, in turns (``PYTHONPATH`` picks the package): eval bf16 at 1 and 8
images and training bf16 at 2 images (3x800x1344), ours and mmdet in the same interleaved
rounds, and each step's host time (until its Python returns, its kernels launched). Appends one
JSON line per run to ``$OUT/host_ab.jsonl``.
"""
import json
import os
import statistics
import sys
import time

import torch

import swin_backbone
from swin_backbone.tools import benchmarking as B

tag = sys.argv[1]
dev = "cuda" if torch.cuda.is_available() else "cpu"
size = (800, 1344) if dev == "cuda" else (64, 96)
models = B.build_pair(dev)
row = {"tag": tag, "package": swin_backbone.__file__, "commit_note": os.environ.get("AB_COMMIT", "")}
for kind, batch, rounds in (("eval", 1, 25), ("eval", 8, 10), ("train", 2, 20)):
    x = torch.randn(batch, 3, *size, device=dev)
    for m in models.values():
        m.train(kind == "train")
    step = B.train_step if kind == "train" else B.eval_step
    fns = {k: step(m, x, torch.bfloat16) for k, m in models.items()}
    times = B.interleave(fns, dev, rounds, 3)
    host = {}
    for k, fn in fns.items():
        launched = []
        for _ in range(rounds):
            B.sync(dev)
            t0 = time.perf_counter()
            fn()
            launched.append(time.perf_counter() - t0)
        host[k] = statistics.median(launched) * 1e3
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = [m / o for m, o in zip(times["mmdet"], times["ours"])] if "mmdet" in times else []
    row[f"{kind}{batch}"] = dict(median_ms=med, host_ms=host,
                                 ours_over_mmdet_median_of_ratios=statistics.median(ratios) if ratios else None)
    print(tag, kind, batch, {k: round(v, 2) for k, v in med.items()}, "host", {k: round(v, 2) for k, v in host.items()},
          flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "host_ab.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
