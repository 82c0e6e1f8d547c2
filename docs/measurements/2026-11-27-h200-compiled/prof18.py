"""One-off GPU measurement (H200, 2026-11-27): where the time of the compiled mode and of a
training step goes. Run from the project root on the device after `source .device/setup.sh`,
with OUT set to a folder. Writes $OUT/profile.json and $OUT/profile_<name>.txt (kernel tables)."""
import json
import os
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from swin_backbone.tools import benchmarking as B

START = time.perf_counter()
OUT = os.environ.get("OUT", ".")
res = {"environment": B.environment()}


def save():
    with open(f"{OUT}/profile.json", "w") as f:
        json.dump(res, f, indent=1)


FAMILIES = [("gemm", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_"), ("attention", r"fmha|flash|attention|efficient"),
            ("inductor (fused triton)", r"^triton_"), ("layer_norm", r"layer_norm|LayerNorm"),
            ("gelu", r"gelu|GeluCUDA"), ("softmax", r"softmax"),
            ("copy / cast / index", r"copy|cast|index|gather|scatter|CatArray|Unrolled|direct_copy|roll|pad"),
            ("reduce", r"reduce"), ("elementwise", r"elementwise|vectorized|fill|add|mul")]


def family(name):
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.I):
            return fam
    return "other"


def dev_time(e):
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, attr):
            return getattr(e, attr)
    return 0.0


def prof(name, fn, n=3):
    fn()
    B.sync(DEV)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        B.sync(DEV)
    wall = (time.perf_counter() - t0) / n
    kernels = [e for e in p.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA") and dev_time(e) > 0]
    total = sum(dev_time(e) for e in kernels) / n / 1e3
    count = sum(e.count for e in kernels) / n
    fams = {}
    for e in kernels:
        f = fams.setdefault(family(e.key), [0.0, 0])
        f[0] += dev_time(e) / n / 1e3
        f[1] += e.count / n
    kernels.sort(key=dev_time, reverse=True)
    lines = [f"{name}: GPU kernel time {total:.2f} ms/iter, {count:.0f} kernels/iter, wall (profiled) {wall*1e3:.1f} ms",
             "", "family | ms/iter | kernels/iter"]
    lines += [f"{k} | {v[0]:.2f} | {v[1]:.0f}" for k, v in sorted(fams.items(), key=lambda kv: -kv[1][0])]
    lines += ["", "kernel | ms/iter | calls/iter"]
    lines += [f"{e.key[:110]} | {dev_time(e) / n / 1e3:.3f} | {e.count / n:.0f}" for e in kernels[:45]]
    with open(f"{OUT}/profile_{name}.txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    res.setdefault("profiles", {})[name] = {"gpu_ms": total, "kernels": count, "wall_ms": wall * 1e3,
                                            "families": {k: round(v[0], 3) for k, v in fams.items()}}
    save()
    print(lines[0], flush=True)


def counters():
    from torch._dynamo.utils import counters as c
    return {"graph_breaks": dict(c["graph_break"]), "unique_graphs": c["stats"]["unique_graphs"]}


def first(name, fn):
    t0 = time.perf_counter()
    fn()
    B.sync(DEV)
    res.setdefault("first_call_s", {})[name] = round(time.perf_counter() - t0, 1)
    print(f"first call {name}: {res['first_call_s'][name]} s  (elapsed {time.perf_counter() - START:.0f} s)", flush=True)


DEV = os.environ.get("DEV", "cuda")  # (DEV=cpu SIZE=64: a smoke run of this script on a CPU)


def main():
    global res
    bf16 = torch.bfloat16
    import torch._dynamo.config as dc
    dc.recompile_limit = 128 if hasattr(dc, "recompile_limit") else None
    models = B.build_pair(DEV)
    ours, mmdet = models["ours"], models["mmdet"]
    h, w = (int(os.environ["SIZE"]),) * 2 if "SIZE" in os.environ else (800, 1344)
    x8 = torch.randn(8, 3, h, w, device=DEV)
    x2 = torch.randn(2, 3, h, w, device=DEV)

    # ---- eval 8x bf16
    ours.eval(); mmdet.eval()
    regional = B.regional_model(ours)
    mmdet_c = torch.compile(mmdet, dynamic=False)
    ev = {"ours": B.eval_step(ours, x8, bf16), "ours_regional": B.eval_step(regional, x8, bf16),
          "mmdet": B.eval_step(mmdet, x8, bf16), "mmdet_compiled": B.eval_step(mmdet_c, x8, bf16)}
    for k in ("ours_regional", "mmdet_compiled"):
        first(f"eval_{k}", ev[k])
    res["eval_counters"] = counters()
    times = B.interleave(ev, DEV, 7, 2)
    res["eval_8x_ms"] = {k: round(sorted(v)[len(v) // 2] * 1e3, 2) for k, v in times.items()}
    print("eval 8x:", res["eval_8x_ms"], flush=True)
    save()
    for k, fn in ev.items():
        prof(f"eval8_{k}", fn)

    # ---- training 2x bf16
    ours.train(); mmdet.train(); regional.train()
    tr = {"ours": B.train_step(ours, x2, bf16), "ours_save_memory": B.with_switches(B.train_step(ours, x2, bf16),
                                                                                      dict(save_memory=True)),
          "ours_regional": B.train_step(regional, x2, bf16), "mmdet": B.train_step(mmdet, x2, bf16)}
    first("train_ours_regional", tr["ours_regional"])
    res["train_counters"] = counters()
    times = B.interleave(tr, DEV, 7, 2)
    res["train_2x_ms"] = {k: round(sorted(v)[len(v) // 2] * 1e3, 2) for k, v in times.items()}
    print("train 2x:", res["train_2x_ms"], flush=True)
    save()
    for k, fn in tr.items():
        prof(f"train2_{k}", fn)
    try:
        res["sdpa_kernels_regional_train"] = B.sdpa_kernels(regional, x2, bf16, True)
    except Exception as err:  # (a report, not a failure)
        res["sdpa_kernels_regional_train"] = repr(err)[:300]
    save()

    # ---- eval 8x, ours' blocks compiled with static shapes (is it the dynamic shapes?)
    if time.perf_counter() - START < 330:
        ours.eval()
        static = B.regional_model(ours, dynamic=False)
        fn = B.eval_step(static, x8, bf16)
        first("eval_ours_regional_static", fn)
        times = B.interleave({"ours": ev["ours"], "ours_regional_static": fn, "mmdet_compiled": ev["mmdet_compiled"]},
                             DEV, 7, 2)
        res["eval_8x_static_ms"] = {k: round(sorted(v)[len(v) // 2] * 1e3, 2) for k, v in times.items()}
        print("eval 8x static blocks:", res["eval_8x_static_ms"], flush=True)
        prof("eval8_ours_regional_static", fn)
    res["seconds"] = round(time.perf_counter() - START, 1)
    save()
    print("done in", res["seconds"], "s")


if __name__ == "__main__":
    main()
