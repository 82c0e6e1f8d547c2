import sys, time, statistics, torch
from swin_backbone.tools import benchmarking as B
from swin_backbone.tools.benchmark import _allow_recompiles
_allow_recompiles()
models = B.build_pair("cpu")
x = torch.randn(2, 3, 512, 512)
v = {"ours": models["ours"], "mmdet": models["mmdet"]}
v["ours_dyn"] = B.regional_model(models["ours"])
v["ours_static"] = B.regional_model(models["ours"], dynamic=False)
v["mmdet_static"] = B.compile_model(models["mmdet"], dynamic=False)
fns = {}
for k, m in v.items():
    m.train()
    fns[k] = B.train_step(m, x)
    t0 = time.perf_counter(); fns[k](); print(k, "first call s", round(time.perf_counter() - t0, 1), flush=True)
t = B.interleave(fns, "cpu", 5, 1)
for k, s in t.items(): print(k, round(statistics.median(s) * 1e3), [round(a * 1e3) for a in s], flush=True)
