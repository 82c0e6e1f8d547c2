"""The prepared GPU run of shape buckets + CUDA graphs (docs/shape-buckets.md, docs/performance.md).

    source .device/setup.sh && python tools/analysis_tools/gpu_buckets.py --json $OUT/buckets.json
    python tools/analysis_tools/gpu_buckets.py --device cpu --smoke      # the same code, tiny, on a CPU

Rows, in order, the JSON rewritten after each (a run cut short keeps what it finished); bf16
autocast, Swin-T, stochastic depth 0.2 as the detection configs:

1. ``stream``: backbone training steps (fwd+bwd, batch 2) over a stream of batch shapes drawn
   from the Mask R-CNN 1x recipe (``swin-buckets``' draws, aspect-ratio grouped, padded to 32):
   mmdet's SwinTransformer eager on the padded batch, ours eager with ``valid_sizes`` (packed), ours
   compiled whole with CUDA graphs on the batch padded to its bucket (800x1344 either way) with
   ``valid_sizes``; per step: mean ms over the stream, peak memory; ours graphs: compile + capture
   time per bucket, graphs added after warm-up (dynamo's count: 0 expected).
2. ``eval``: one 1x3x800x1344 image: mmdet eager, ours eager, ours compiled whole with CUDA graphs.
3. ``mask_rcnn``: whole Mask R-CNN iterations (``model.train_step`` with ``AmpOptimWrapper`` bf16,
   AdamW, batch 2, images of the 1x recipe's sizes with boxes and masks) as mmengine times them:
   the stock mmdet config, ours with one word swapped, ours with the bucket config (its backbone
   the stream's compiled one: no second compile).
4. ``upernet`` (if the budget allows): UPerNet Swin-T 2x3x512x512 iterations, stock against ours
   eager and ours compiled whole with CUDA graphs (``configs/mmseg/upernet_swin-t_cudagraphs_...``).
5. ``compiled_mmdet`` (a call of its own: ``--rows compiled_mmdet``): the stream's landscape
   batches, mmdet compiled as a user would beside ours with buckets and CUDA graphs, first pass
   (compiling) times and peak memory including the CUDA graph pools.
6. ``memory`` (a call of its own): peak training memory at the 800x1344 bucket with the graphs'
   pools counted, ours graphs with and without ``save_memory``, beside mmdet and ours eager.
7. ``losses`` (a call of its own): 200 Mask R-CNN iterations, backbone eager against compiled
   whole with CUDA graphs, the same weights, data and seeds: the two loss curves.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]  # the checkout's package; benchmarking.py

from swin_backbone import SwinBackbone, load_checkpoint  # noqa: E402
import benchmarking as B  # noqa: E402  (beside this file)
from swin_backbone.tools import buckets as bucket_tool  # noqa: E402
from swin_backbone.buckets import choose_bucket  # noqa: E402

ARCH = dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24))
GRAPHS = dict(mode="reduce-overhead", dynamic=False, regions=False)
CONFIG_1X = "mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py"
SAVE = [lambda: None]  #: writes the JSON (set by main)


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def peak_reset(device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak_mib(device, base):
    if device == "cuda":
        torch.cuda.synchronize()
        return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    return None


def backbones(device, drop_path):
    from mmdet.models.backbones import SwinTransformer

    torch.manual_seed(0)
    ref = SwinTransformer(**ARCH, drop_path_rate=drop_path)
    ref.init_weights()
    ours = SwinBackbone(arch=None, **ARCH, drop_path_rate=drop_path)
    load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    graphs_model = SwinBackbone(arch=None, **ARCH, drop_path_rate=drop_path, compile=GRAPHS)
    graphs_model.load_state_dict(ours.state_dict())
    models = {"mmdet": ref.to(device), "ours": ours.to(device), "ours_graphs": graphs_model.to(device)}
    for m in models.values():
        m.train()  # (mmdet's train() returns None)
    return models


def stream_batches(args):
    cfg = bucket_tool.read_config(CONFIG_1X)
    batches, _ = bucket_tool.draw_batches(cfg, draws=args.stream, seed=0)
    if args.smoke:  # tiny: the same shapes scaled down
        small = [tuple((max(ih // 16, 8), max(iw // 16, 8)) for ih, iw in imgs) for _, imgs in batches]
        batches = [(tuple(bucket_tool.pad_up(max(s[i] for s in imgs), 32) for i in (0, 1)), imgs) for imgs in small]
    return batches


def make_input(shape, sizes, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(sizes), 3, *shape)
    for b, (h, w) in enumerate(sizes):
        x[b, :, :h, :w] = torch.randn(3, h, w, generator=g)
    return x.to(device)


def train_backbone(model, x, sizes=None):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        outs = model(x) if sizes is None else model(x, valid_sizes=sizes)
    sum(o.float().mean() for o in outs).backward()
    model.zero_grad(set_to_none=True)


def per_step_ms(passes, device, rounds, steps, reference="mmdet", digits=2):
    """Median ms per step of each of ``passes`` (callables of ``steps`` steps each) over ``rounds``
    interleaved rounds (``benchmarking.interleave``), and each one's speedup over ``reference``."""
    times = B.interleave(passes, device, rounds, warmup=0)
    ms = {k: round(statistics.median(v) / steps * 1e3, digits) for k, v in times.items()}
    return ms, {k: round(ms[reference] / v, 2) for k, v in ms.items()}


def timed_rounds(row, runs, items, device, rounds):
    """``rounds`` interleaved passes of each of ``runs`` over ``items``: the row's ``ms_per_step``
    (medians) and ``speedup_vs_mmdet``."""
    passes = {k: (lambda run=run: [run(x, b, s) for x, b, s in items]) for k, run in runs.items()}
    row["ms_per_step"], row["speedup_vs_mmdet"] = per_step_ms(passes, device, rounds, len(items))


def row_stream(args, results, device):
    bucket_set = [(800, 1344)] if not args.smoke else [(64, 96)]
    batches = stream_batches(args)
    models = backbones(device, 0.2)
    items = []
    for i, (shape, imgs) in enumerate(batches):
        bucket = choose_bucket(*shape, bucket_set) or shape
        items.append((make_input(shape, imgs, device, i), make_input(bucket, imgs, device, i), list(imgs)))
    row = {"batches": len(items), "distinct_shapes": len({tuple(x.shape[-2:]) for x, _, _ in items}),
           "buckets": bucket_set, "bucket_shapes": sorted({tuple(b.shape[-2:]) for _, b, _ in items})}
    # compile + capture per bucket shape (first call, and the second: CUDA graph trees record then)
    first = {}
    for _, b, imgs in items:
        key = "x".join(map(str, b.shape[-2:]))
        if key in first:
            continue
        t0 = time.perf_counter()
        train_backbone(models["ours_graphs"], b, imgs)
        B.sync(device)
        t1 = time.perf_counter()
        train_backbone(models["ours_graphs"], b, imgs)
        B.sync(device)
        first[key] = {"first_call_s": round(t1 - t0, 1), "second_call_s": round(time.perf_counter() - t1, 2)}
    row["compile_and_capture"] = first
    runs = {"mmdet": lambda x, b, s: train_backbone(models["mmdet"], x),
            "ours": lambda x, b, s: train_backbone(models["ours"], x, s),
            "ours_graphs": lambda x, b, s: train_backbone(models["ours_graphs"], b, s)}
    for run in runs.values():  # warm-up pass (eager caches, the graphs' remaining recordings)
        for x, b, s in items:
            run(x, b, s)
    before = graphs()
    timed_rounds(row, runs, items, device, args.rounds)
    row["graphs_added_after_warmup"] = graphs() - before
    mem = {}
    x, b, s = max(items, key=lambda it: it[0].numel())
    for name, run in runs.items():
        base = peak_reset(device)
        run(x, b, s)
        mem[name] = peak_mib(device, base)
    row["peak_step_memory_mib_largest_batch"] = mem
    results["stream"] = row
    return models


def row_compiled_mmdet(args, results, device):
    """The landscape batches of the stream (one bucket, 800x1344): mmdet eager, mmdet
    ``torch.compile``d as a user would (defaults: static first, dynamic shapes after a size
    change), ours eager, ours with buckets and CUDA graphs; each model's first pass (compiling)
    timed and its peak memory over it (CUDA graph pools included), then interleaved rounds."""
    batches = [(shape, imgs) for shape, imgs in stream_batches(args) if shape[0] <= shape[1]]
    bucket_set = [(800, 1344)] if not args.smoke else [(64, 96)]
    models = backbones(device, 0.2)
    models["mmdet_compiled"] = torch.compile(copy.deepcopy(models["mmdet"]))
    items = []
    for i, (shape, imgs) in enumerate(batches):
        bucket = choose_bucket(*shape, bucket_set) or shape
        items.append((make_input(shape, imgs, device, i), make_input(bucket, imgs, device, i), list(imgs)))
    runs = {"mmdet": lambda x, b, s: train_backbone(models["mmdet"], x),
            "mmdet_compiled": lambda x, b, s: train_backbone(models["mmdet_compiled"], x),
            "ours": lambda x, b, s: train_backbone(models["ours"], x, s),
            "ours_graphs": lambda x, b, s: train_backbone(models["ours_graphs"], b, s)}
    row = {"batches": len(items), "distinct_shapes": len({tuple(x.shape[-2:]) for x, _, _ in items}),
           "first_pass_s": {}, "peak_memory_mib_first_pass": {}}
    for name, run in runs.items():
        base = peak_reset(device)
        t0 = time.perf_counter()
        for x, b, s in items:
            run(x, b, s)
        B.sync(device)
        row["first_pass_s"][name] = round(time.perf_counter() - t0, 1)
        row["peak_memory_mib_first_pass"][name] = peak_mib(device, base)
        results["compiled_mmdet"] = row
        SAVE[0]()  # (each first pass may take minutes: kept if the call runs out of time)
    before = graphs()
    timed_rounds(row, runs, items, device, args.rounds)
    row["graphs_added_after_first_pass"] = graphs() - before
    results["compiled_mmdet"] = row


def row_memory(args, results, device):
    """Peak memory of a training step at the 800x1344 bucket including CUDA graph pools (each
    model's peak over its first call, compiling and capturing, and 3 more steps), and step time:
    mmdet eager, ours eager, ours graphs with ``save_memory`` False and True (a call of its own)."""
    size = (64, 96) if args.smoke else (800, 1344)
    sizes = [size, (size[0] * 3 // 4, size[1])]
    x = make_input(size, sizes, device, 0)
    base_models = backbones(device, 0.2)
    lean = SwinBackbone(arch=None, **ARCH, drop_path_rate=0.2, compile=GRAPHS, save_memory=True)
    lean.load_state_dict(base_models["ours"].state_dict())
    models = {"mmdet": base_models["mmdet"], "ours": base_models["ours"], "ours_graphs": base_models["ours_graphs"],
              "ours_graphs_save_memory": lean.to(device).train()}
    runs = {k: (lambda m, k=k: (lambda: train_backbone(m, x) if k == "mmdet" else train_backbone(m, x, sizes)))(m)
            for k, m in models.items()}
    row = {"size": list(size), "peak_mib": {}, "first_call_s": {}}
    results["memory"] = row
    for name, run in runs.items():
        base = peak_reset(device)
        t0 = time.perf_counter()
        run()
        B.sync(device)
        row["first_call_s"][name] = round(time.perf_counter() - t0, 1)
        for _ in range(3):
            run()
        row["peak_mib"][name] = peak_mib(device, base)
        SAVE[0]()
    passes = {k: (lambda run=run: [run() for _ in range(5)]) for k, run in runs.items()}
    row["ms"], row["speedup_vs_mmdet"] = per_step_ms(passes, device, args.rounds * 5, 5)
    row["memory_vs_mmdet"] = {k: round(v / row["peak_mib"]["mmdet"], 2) for k, v in row["peak_mib"].items()
                              if v is not None and row["peak_mib"]["mmdet"]}


def row_losses(args, results, device):
    """Mask R-CNN 1x with the 800x1344 bucket, stochastic depth off, the same weights, data and
    seeds: ``--loss-iters`` training iterations with the backbone eager and compiled whole with
    CUDA graphs; the two loss curves (a call of its own)."""
    cfg = bucket_tool.read_config("mmdet/mask-rcnn_swin-t-p4-w7_fpn_buckets-cudagraphs_1x_coco.py")
    cfg.model.backbone.pop("init_cfg", None)
    cfg.model.backbone.drop_path_rate = 0.0
    if args.smoke:
        cfg.model.data_preprocessor.buckets = [(64, 96)]
    dets = {}
    for name, compile in (("eager", False), ("graphs", dict(GRAPHS))):
        cfg.model.backbone.compile = compile
        dets[name] = build_detector(cfg, device)
    dets["graphs"].load_state_dict(dets["eager"].state_dict())
    batches = stream_batches(args)
    data = [det_data(imgs, device, i) for i, (_, imgs) in enumerate(batches)]
    row = {"iterations": args.loss_iters, "loss": {}}
    results["losses"] = row
    for name, det in dets.items():
        wrapper = optim_wrapper(det)
        losses = []
        t0 = time.perf_counter()
        for step in range(args.loss_iters):
            torch.manual_seed(step)  # (the heads' samplers)
            log = det.train_step(copy.copy(data[step % len(data)]), wrapper)
            losses.append(round(float(log["loss"]), 5))
        row["loss"][name] = losses
        row[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        SAVE[0]()
    e, g = np.array(row["loss"]["eager"]), np.array(row["loss"]["graphs"])
    row["max_abs_diff"] = float(np.abs(e - g).max())
    row["max_rel_diff"] = float((np.abs(e - g) / np.abs(e).clip(1e-6)).max())
    row["last20_mean"] = {"eager": float(e[-20:].mean()), "graphs": float(g[-20:].mean())}


def row_eval(args, results, device, models):
    size = (64, 96) if args.smoke else (800, 1344)
    x = make_input(size, [size], device, 0)
    eager = {k: copy.deepcopy(models[k]) for k in ("mmdet", "ours")}
    for m in eager.values():
        m.eval()
    whole = SwinBackbone(arch=None, **ARCH, compile=GRAPHS).to(device).eval()
    whole.load_state_dict(models["ours"].state_dict())
    eager["ours_graphs"] = whole

    def run(m):
        with torch.inference_mode(), torch.autocast(x.device.type, dtype=torch.bfloat16):
            m(x)

    t0 = time.perf_counter()
    run(whole)
    B.sync(device)
    row = {"first_call_s": round(time.perf_counter() - t0, 1)}
    for m in eager.values():
        for _ in range(3):
            run(m)
    passes = {k: (lambda m=m: [run(m) for _ in range(5)]) for k, m in eager.items()}
    row["ms"], row["speedup_vs_mmdet"] = per_step_ms(passes, device, args.rounds * 5, 5)
    results["eval_1x800x1344"] = row


def det_data(shapes, device, seed):
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData

    g = np.random.default_rng(seed)
    inputs, samples = [], []
    for h, w in shapes:
        inputs.append(torch.from_numpy(g.integers(0, 255, (3, h, w), dtype=np.uint8)))
        boxes = []
        for _ in range(3):
            x0, y0 = g.integers(0, w // 2), g.integers(0, h // 2)
            boxes.append([x0, y0, x0 + g.integers(16, w // 2), y0 + g.integers(16, h // 2)])
        masks = np.zeros((3, h, w), np.uint8)
        for i, (x0, y0, x1, y1) in enumerate(boxes):
            masks[i, y0:y1, x0:x1] = 1
        s = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w), scale_factor=(1.0, 1.0), flip=False))
        s.gt_instances = InstanceData(bboxes=torch.tensor(boxes, dtype=torch.float32),
                                      labels=torch.tensor([1, 2, 3]), masks=BitmapMasks(masks, h, w))
        samples.append(s)
    return dict(inputs=inputs, data_samples=samples)


def build_detector(cfg, device):
    from mmdet.registry import MODELS
    from mmengine.registry import DefaultScope

    torch.manual_seed(0)
    with DefaultScope.overwrite_default_scope("mmdet"):
        model = MODELS.build(cfg.model)
    model.init_weights()
    return model.to(device).train()


def optim_wrapper(model):
    from mmengine.optim import AmpOptimWrapper, OptimWrapper

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    if next(model.parameters()).is_cuda:
        return AmpOptimWrapper(optimizer=opt, dtype="bfloat16")
    return OptimWrapper(optimizer=opt)


def row_mask_rcnn(args, results, device, models):
    from mmengine.config import Config

    import mmdet

    mmdet_root = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs")
    stock = Config.fromfile(os.path.join(mmdet_root, "swin", "mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py"))
    ours = bucket_tool.read_config(CONFIG_1X)
    bucketed = bucket_tool.read_config("mmdet/mask-rcnn_swin-t-p4-w7_fpn_buckets-cudagraphs_1x_coco.py")
    for cfg in (stock, ours, bucketed):
        cfg.model.backbone.pop("init_cfg", None)
        if args.smoke:
            cfg.model.data_preprocessor.pad_size_divisor = 32
    bucketed.model.backbone.compile = False  # (its backbone: the stream's compiled one, below)
    if args.smoke:
        bucketed.model.data_preprocessor.buckets = [(64, 96)]
    dets = {"stock": build_detector(stock, device), "ours": build_detector(ours, device),
            "ours_buckets_graphs": build_detector(bucketed, device)}
    dets["ours_buckets_graphs"].backbone = models["ours_graphs"]
    wrappers = {k: optim_wrapper(m) for k, m in dets.items()}
    batches = stream_batches(args)[: args.iters]
    data = [det_data(imgs, device, i) for i, (_, imgs) in enumerate(batches)]
    row = {"iterations": len(data)}

    def step(name, d):
        dets[name].train_step(copy.copy(d), wrappers[name])

    for name in dets:
        for d in data[:4]:
            step(name, d)
    before = graphs()
    passes = {name: (lambda name=name: [step(name, d) for d in data]) for name in dets}
    row["ms_per_iter"], row["speedup_vs_stock"] = per_step_ms(passes, device, args.rounds, len(data), "stock", 1)
    row["graphs_added"] = graphs() - before
    mem = {}
    for name in dets:
        base = peak_reset(device)
        step(name, data[0])
        mem[name] = peak_mib(device, base)
    row["peak_iter_memory_mib"] = mem
    results["mask_rcnn_1x"] = row


def row_upernet(args, results, device):
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample
    from mmengine.structures import PixelData
    import mmseg

    root = os.path.join(os.path.dirname(mmseg.__file__), ".mim", "configs")
    stock = Config.fromfile(os.path.join(root, "swin",
                                         "swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py"))
    ours = bucket_tool.read_config("mmseg/upernet_swin-t_512x512_160k_ade20k.py")
    graphs_cfg = bucket_tool.read_config("mmseg/upernet_swin-t_cudagraphs_512x512_160k_ade20k.py")
    size = 64 if args.smoke else 512
    models = {}
    for name, cfg in (("stock", stock), ("ours", ours), ("ours_graphs", graphs_cfg)):
        cfg.model.pop("pretrained", None)
        cfg.model.backbone.pop("init_cfg", None)
        cfg.model.data_preprocessor.size = (size, size)
        if name == "ours_graphs":
            cfg.model.backbone.compile = dict(GRAPHS)
        torch.manual_seed(0)
        with DefaultScope.overwrite_default_scope("mmseg"):
            m = MODELS.build(cfg.model)
        m.init_weights()
        models[name] = m.to(device).train()
    g = np.random.default_rng(0)

    def data(seed):
        inputs, samples = [], []
        for _ in range(2):
            inputs.append(torch.from_numpy(g.integers(0, 255, (3, size, size), dtype=np.uint8)))
            s = SegDataSample(metainfo=dict(img_shape=(size, size), ori_shape=(size, size), pad_shape=(size, size)))
            s.gt_sem_seg = PixelData(data=torch.from_numpy(g.integers(0, 150, (1, size, size))).long())
            samples.append(s)
        return dict(inputs=inputs, data_samples=samples)

    batches = [data(i) for i in range(args.iters)]
    wrappers = {k: optim_wrapper(m) for k, m in models.items()}
    t0 = time.perf_counter()
    models["ours_graphs"].train_step(copy.copy(batches[0]), wrappers["ours_graphs"])
    B.sync(device)
    row = {"first_call_s": round(time.perf_counter() - t0, 1)}
    for name, m in models.items():
        for d in batches[:3]:
            m.train_step(copy.copy(d), wrappers[name])
    passes = {name: (lambda m=m, w=wrappers[name]: [m.train_step(copy.copy(d), w) for d in batches])
              for name, m in models.items()}
    row["ms_per_iter"], row["speedup_vs_stock"] = per_step_ms(passes, device, args.rounds, len(batches), "stock", 1)
    results["upernet_512"] = row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default="gpu_buckets.json")
    p.add_argument("--stream", type=int, default=24, help="batches in the detection stream")
    p.add_argument("--iters", type=int, default=8, help="iterations per round of the whole-model rows")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which later rows are skipped")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the code)")
    p.add_argument("--rows", default="stream,eval,mask_rcnn,upernet",
                   help="also: compiled_mmdet, memory, losses (each a call of its own on an H200)")
    p.add_argument("--loss-iters", type=int, default=200, help="iterations of the losses row")
    args = p.parse_args(argv)
    device = args.device
    import logging

    from mmengine.logging import MMLogger

    MMLogger.get_current_instance().setLevel(logging.WARNING)  # (init_weights' per-parameter lines)
    if device == "cpu":  # (the code path only: inductor's CPU compile of Swin-T takes minutes)
        GRAPHS.update(backend="aot_eager", mode=None)
    start = time.perf_counter()
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "argv": sys.argv[1:], "errors": {}, "skipped": []}
    try:
        import subprocess
        results["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    except OSError:
        pass

    def save():
        results["elapsed_s"] = round(time.perf_counter() - start, 1)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(json.dumps(results, default=str), flush=True)

    SAVE[0] = save
    models = None
    rows = args.rows.split(",")
    for name in rows:
        if time.perf_counter() - start > args.budget:
            results["skipped"].append(name)
            continue
        try:
            if name == "stream":
                models = row_stream(args, results, device)
            elif name == "eval":
                row_eval(args, results, device, models)
            elif name == "mask_rcnn":
                row_mask_rcnn(args, results, device, models)
            elif name == "upernet":
                row_upernet(args, results, device)
            elif name == "compiled_mmdet":
                row_compiled_mmdet(args, results, device)
            elif name == "memory":
                row_memory(args, results, device)
            elif name == "losses":
                row_losses(args, results, device)
        except Exception as err:  # recorded, the next row still runs
            results["errors"][name] = traceback.format_exc()[-3000:]
            print(f"{name}: {type(err).__name__}: {err}", flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
