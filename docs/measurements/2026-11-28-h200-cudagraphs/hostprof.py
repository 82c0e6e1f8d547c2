"""One-off GPU measurement (H200, 2026-11-28): where a training step's host time goes, ours
and mmdet's (bf16, 2x3x800x1344), and eval at 1 image. Writes $OUT/hostprof.json and
$OUT/hostprof_<name>.txt (profiler self-CPU tables, cProfile of the forward)."""
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from swin_backbone.tools import benchmarking as B

START = time.perf_counter()
OUT = os.environ.get("OUT", ".")
DEV = os.environ.get("DEV", "cuda")
SIZE = tuple(int(s) for s in os.environ.get("SIZE", "800,1344").split(","))
ITERS = int(os.environ.get("ITERS", "11"))
res = {"environment": B.environment(), "size": SIZE}
bf16 = torch.bfloat16


def save():
    with open(f"{OUT}/hostprof.json", "w") as f:
        json.dump(res, f, indent=1)


def fwd(model, x):
    with torch.autocast(x.device.type, dtype=bf16):
        outs = model(x)
    return sum(o.float().mean() for o in outs)


def split(model, x):
    """Medians of host forward, host backward, step (ms)."""
    f, b, s = [], [], []
    for i in range(ITERS + 2):
        B.sync(DEV)
        t0 = time.perf_counter()
        loss = fwd(model, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        B.sync(DEV)
        t3 = time.perf_counter()
        if i >= 2:
            f.append(t1 - t0); b.append(t2 - t1); s.append(t3 - t0)
    return {k: round(statistics.median(v) * 1e3, 2) for k, v in (("host_fwd_ms", f), ("host_bwd_ms", b), ("step_ms", s))}


LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def prof(name, fn, n=3):
    fn(); B.sync(DEV)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        B.sync(DEV)
    ev = p.events()
    top = [e for e in ev if e.cpu_parent is None]
    launches = [e for e in ev if e.name in LAUNCH]
    row = {"top_level_events_per_iter": len(top) / n,
           "top_level_aten_per_iter": sum(e.name.startswith("aten::") for e in top) / n,
           "autograd_nodes_per_iter": sum(e.name.startswith("autograd::engine::evaluate_function") for e in ev) / n,
           "aten_ops_all_per_iter": sum(e.name.startswith("aten::") for e in ev) / n,
           "launches_per_iter": len(launches) / n,
           "launch_cpu_ms_per_iter": sum(e.cpu_time_total for e in launches) / n / 1e3,
           "memcpy_per_iter": sum("Memcpy" in e.name or "cudaMemcpy" in e.name for e in ev) / n,
           "sync_per_iter": sum("Synchronize" in e.name for e in ev) / n}
    res.setdefault("profiles", {})[name] = row
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    with open(f"{OUT}/hostprof_{name}.txt", "w") as f:
        f.write(json.dumps(row) + "\n\n" + table + "\n")
    save()
    print(name, row, flush=True)


def pyprof(name, fn, n=5):
    fn(); B.sync(DEV)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    B.sync(DEV)
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(35)
    with open(f"{OUT}/hostprof_py_{name}.txt", "w") as f:
        f.write(f"{n} calls\n" + s.getvalue())


def main():
    models = B.build_pair(DEV)
    h, w = SIZE
    x2 = torch.randn(2, 3, h, w, device=DEV)
    x1 = torch.randn(1, 3, h, w, device=DEV)
    for m in models.values():
        m.train()
        split(m, x2)  # warm
    res["train_split"] = {}
    for r in range(3):  # interleaved
        for k, m in models.items():
            res["train_split"].setdefault(k, []).append(split(m, x2))
    print("train split", res["train_split"], flush=True)
    save()
    for k, m in models.items():
        prof(f"train2_{k}", B.train_step(m, x2, bf16))
        pyprof(f"train2_fwd_{k}", lambda m=m: fwd(m, x2).backward())
    for k, m in models.items():
        m.eval()
        fn = B.eval_step(m, x1, bf16)
        for _ in range(3):
            fn()
        res.setdefault("eval1_host_step_ms", {})[k] = [round(t * 1e3, 2) for t in B.host_and_step(fn, DEV, ITERS)]
        prof(f"eval1_{k}", fn)
    res["seconds"] = round(time.perf_counter() - START, 1)
    save()
    print("done", res["seconds"], flush=True)


if __name__ == "__main__":
    main()
