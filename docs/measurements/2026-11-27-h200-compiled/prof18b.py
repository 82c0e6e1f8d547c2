"""One-off GPU measurement (H200, 2026-11-27, second device call): the compiled mode with all its
regions (blocks, patch embedding, mergings, output norms) against blocks only, eager, mmdet eager
and compiled. From the project root on the device after `source .device/setup.sh`, OUT set."""
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from prof18 import prof, res, save, first, counters, START  # noqa: E402  (the first call's helpers)
from swin_backbone.model.compiled import allow_recompiles  # noqa: E402
from swin_backbone.tools import benchmarking as B  # noqa: E402
from swin_backbone.validation import check_compile  # noqa: E402

res.clear()
res["environment"] = B.environment()
DEV, bf16 = os.environ.get("DEV", "cuda"), torch.bfloat16
allow_recompiles()
models = B.build_pair(DEV)
ours, mmdet = models["ours"], models["mmdet"]
h, w = (int(os.environ["SIZE"]),) * 2 if "SIZE" in os.environ else (800, 1344)
x8 = torch.randn(8, 3, h, w, device=DEV)
x2 = torch.randn(2, 3, h, w, device=DEV)


def blocks_only(model):
    m = copy.deepcopy(model)
    m.compile_options = check_compile(True)
    for stage in m.stages:
        for block in stage.blocks:
            block.compile(**m.compile_options)
    return m


def med(times):
    return {k: round(sorted(v)[len(v) // 2] * 1e3, 2) for k, v in times.items()}


ours.eval(); mmdet.eval()
regional = B.regional_model(ours)
ev = {"ours": B.eval_step(ours, x8, bf16), "ours_regional": B.eval_step(regional, x8, bf16),
      "mmdet": B.eval_step(mmdet, x8, bf16)}
first("eval_ours_regional", ev["ours_regional"])
mmdet_static = torch.compile(mmdet, dynamic=False)
ev["mmdet_compiled_static"] = B.eval_step(mmdet_static, x8, bf16)
first("eval_mmdet_compiled_static", ev["mmdet_compiled_static"])
blocks = blocks_only(ours)
ev["ours_blocks_only"] = B.eval_step(blocks, x8, bf16)
first("eval_ours_blocks_only", ev["ours_blocks_only"])
res["eval_counters"] = counters()
res["eval_8x_ms"] = med(B.interleave(ev, DEV, 9, 2))
print("eval 8x:", res["eval_8x_ms"], flush=True)
save()
prof("eval8_ours_regional", ev["ours_regional"])

# another size and batch: no new graph for ours
before = counters()["unique_graphs"]
x6 = torch.randn(6, 3, h - 64, w - 64, device=DEV)
B.eval_step(regional, x6, bf16)()
res["eval_other_size_new_graphs"] = counters()["unique_graphs"] - before
print("new graphs at 6x3x736x1280:", res["eval_other_size_new_graphs"], flush=True)
save()

ours.train(); mmdet.train(); regional.train()
tr = {"ours": B.train_step(ours, x2, bf16), "ours_regional": B.train_step(regional, x2, bf16),
      "mmdet": B.train_step(mmdet, x2, bf16)}
first("train_ours_regional", tr["ours_regional"])
res["train_counters"] = counters()
res["train_2x_ms"] = med(B.interleave(tr, DEV, 9, 2))
print("train 2x:", res["train_2x_ms"], flush=True)
save()
prof("train2_ours_regional", tr["ours_regional"])
prof("train2_ours", tr["ours"])

if time.perf_counter() - START < 300:
    mmdet.eval()
    dyn = torch.compile(mmdet, dynamic=True)
    fn = B.eval_step(dyn, x8, bf16)
    first("eval_mmdet_compiled_dynamic", fn)
    regional.eval()
    res["eval_8x_dynamic_ms"] = med(B.interleave({"ours_regional": ev["ours_regional"], "mmdet_compiled_dynamic": fn,
                                                  "mmdet_compiled_static": ev["mmdet_compiled_static"]}, DEV, 9, 2))
    print("eval 8x vs mmdet dynamic:", res["eval_8x_dynamic_ms"], flush=True)
res["seconds"] = round(time.perf_counter() - START, 1)
save()
print("done in", res["seconds"], "s")
