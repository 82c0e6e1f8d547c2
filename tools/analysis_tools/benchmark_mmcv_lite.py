#!/usr/bin/env python
"""Speed of mmcv-lite's ops (swin_backbone.mmcv_lite) against compiled mmcv, in one process.

Run it where compiled mmcv is installed (the torch 2.1 stack: .venv-torch2.1), on a quiet machine:

    .venv-torch2.1/bin/python tools/analysis_tools/benchmark_mmcv_lite.py [--device cpu] [--json out.json]

Each covered op is timed forward and backward (the ``_ext`` functions mmcv's autograd Functions
call, at the sizes the Swin detectors use), mmcv-lite against compiled mmcv, interleaved round by
round, median of ``--rounds``. Where compiled mmcv 2.1.0 has no kernel for the device (ms_deform_attn
and sigmoid_focal_loss are CUDA-only there) the baseline is what mmcv / mmdet run instead: mmcv's
``multi_scale_deformable_attn_pytorch`` and mmdet's ``py_sigmoid_focal_loss`` with autograd. Then
one training step (loss + backward) of the toy Mask R-CNN (configs/toy), its mmcv layers bound to
each ``_ext`` in turn. Without compiled mmcv (mmcv-lite environments) only mmcv-lite is timed.
docs/mmcv-lite.md quotes the table.
"""
import argparse
import importlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from swin_backbone.mmcv_lite import bound_to, compiled_ext  # noqa: E402
from swin_backbone.mmcv_lite import ext as lite  # noqa: E402

TOY_DET = os.path.join(ROOT, "configs", "toy", "mask-rcnn_swin-toy_fpn_toy-coco.py")


# ------------------------------------------------------------------------------- cases
def cases(device, quick):
    """{op: (forward(ext), backward(ext), fallback forward, fallback backward)}: each a
    zero-argument callable per ext; a fallback is what runs where compiled mmcv has no kernel."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.rand(*shape, generator=g).to(device)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    s = 4 if quick else 1
    out = {}

    # NMS: RPN proposals of one image (mmdet's Mask R-CNN: nms_pre 1000 per level, iou 0.7)
    n = 4000 // s
    xy = rand(n, 2) * 800
    boxes = torch.cat([xy, xy + rand(n, 2) * 200 + 4], 1)
    scores = rand(n)
    out["nms"] = (lambda e: e.nms(boxes, scores, iou_threshold=0.7, offset=0), None)

    # RoIAlign: Mask R-CNN's box head, 512 sampled RoIs x 256 channels, 7 x 7, on a stride-8 level
    feat = randn(2, 256 // s, 100 // s, 168 // s)
    k = 1024 // s
    xy = rand(k, 2) * torch.tensor([600.0 / s, 350.0 / s], device=device)
    rois = torch.cat([torch.randint(0, 2, (k, 1), generator=g).float().to(device), xy,
                      xy + rand(k, 2) * 200 / s + 8], 1)
    ra = dict(aligned_height=7, aligned_width=7, spatial_scale=0.125, sampling_ratio=0, pool_mode=1, aligned=True)
    empty = feat.new_zeros(0)
    ra_out = feat.new_zeros(k, feat.size(1), 7, 7)
    ra_grad_out = randn(k, feat.size(1), 7, 7)
    ra_grad_in = torch.zeros_like(feat)
    out["roi_align"] = (lambda e: e.roi_align_forward(feat, rois, ra_out, empty, empty, **ra),
                        lambda e: e.roi_align_backward(ra_grad_out, rois, empty, empty, ra_grad_in, **ra))

    # modulated deformable conv: DyHead's 3 x 3 DCNv2, 256 channels, a stride-8 level
    c, h, w = 256 // s, 100 // s, 168 // s
    x, weight, bias = randn(2, c, h, w), randn(c, c, 3, 3) * 0.05, randn(c)
    offset, mask = randn(2, 18, h, w), rand(2, 9, h, w)
    dcn = dict(kernel_h=3, kernel_w=3, stride_h=1, stride_w=1, pad_h=1, pad_w=1, dilation_h=1, dilation_w=1,
               group=1, deformable_group=1, with_bias=True)
    dcn_out, dcn_go = x.new_zeros(2, c, h, w), randn(2, c, h, w)
    dcn_grads = [torch.zeros_like(t) for t in (x, weight, bias, offset, mask)]

    def dcn_bwd(e):
        gi, gw, gb, go, gm = dcn_grads
        e.modulated_deform_conv_backward(x, weight, bias, empty, offset, mask, empty, gi, gw, gb, go, gm, dcn_go,
                                         **dcn)

    out["modulated_deform_conv"] = (
        lambda e: e.modulated_deform_conv_forward(x, weight, bias, empty, offset, mask, dcn_out, empty, **dcn),
        dcn_bwd)

    # multi-scale deformable attention: DINO's encoder, 4 levels of an 800 x 1333 image, 8 heads x 32
    shapes = torch.tensor([(100, 167), (50, 84), (25, 42), (13, 21)], device=device) // s
    shapes = shapes.clamp(min=1)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    keys = int((shapes[:, 0] * shapes[:, 1]).sum())
    q = min(keys, 900 * (4 // s if quick else 4))
    value, loc = randn(1, keys, 8, 32), rand(1, q, 8, 4, 4, 2)
    attn = rand(1, q, 8, 4, 4).softmax(-1)
    msda_go = randn(1, q, 256)
    msda_grads = [torch.zeros_like(t) for t in (value, loc, attn)]

    def msda_fallback_fwd():
        from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch

        return multi_scale_deformable_attn_pytorch(value, shapes, loc, attn)

    def msda_fallback_bwd():
        from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch

        leaves = [t.detach().requires_grad_(True) for t in (value, loc, attn)]
        outp = multi_scale_deformable_attn_pytorch(leaves[0], shapes, leaves[1], leaves[2])
        torch.autograd.grad(outp, leaves, msda_go)

    out["ms_deform_attn"] = (
        lambda e: e.ms_deform_attn_forward(value, shapes, starts, loc, attn, im2col_step=64),
        lambda e: e.ms_deform_attn_backward(value, shapes, starts, loc, attn, msda_go, *msda_grads, im2col_step=64),
        msda_fallback_fwd, msda_fallback_bwd)

    # sigmoid focal loss: RetinaNet's anchors of one 800 x 1333 image x 80 classes
    m = 120000 // (s * s)
    logits, labels = randn(m, 80), torch.randint(0, 81, (m,), generator=g).to(device)
    fl_out, fl_grad = torch.zeros_like(logits), torch.zeros_like(logits)

    def focal_fallback(backward):
        from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss

        x_ = logits.detach().requires_grad_(backward)
        onehot = torch.nn.functional.one_hot(labels, 81)[:, :80].float()
        loss = py_sigmoid_focal_loss(x_, onehot, gamma=2.0, alpha=0.25, reduction="none")
        if backward:
            torch.autograd.grad(loss.sum(), x_)

    out["sigmoid_focal_loss"] = (
        lambda e: e.sigmoid_focal_loss_forward(logits, labels, empty, fl_out, gamma=2.0, alpha=0.25),
        lambda e: e.sigmoid_focal_loss_backward(logits, labels, empty, fl_grad, gamma=2.0, alpha=0.25),
        lambda: focal_fallback(False), lambda: focal_fallback(True))
    return out


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1000


def runs(fn, device):
    """Whether ``fn`` runs here (compiled mmcv 2.1.0 lacks some kernels on the CPU)."""
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def bench_ops(device, rounds, quick, compiled):
    results = []
    for op, case in cases(device, quick).items():
        fwd, bwd = case[0], case[1]
        fallback = case[2:] if len(case) > 2 else (None, None)
        for phase, fn, fb in (("forward", fwd, fallback[0]), ("backward", bwd, fallback[1])):
            if fn is None:
                continue
            contenders = {"mmcv-lite": lambda fn=fn: fn(lite)}
            baseline = "not installed"
            if compiled is not None:
                if runs(lambda fn=fn: fn(compiled), device):
                    contenders["compiled"] = lambda fn=fn: fn(compiled)
                    baseline = "compiled mmcv"
                elif fb is not None:
                    contenders["compiled"] = fb
                    baseline = "no compiled kernel here: mmcv / mmdet's PyTorch fallback"
                else:
                    baseline = "no compiled kernel here"
            times = {name: [] for name in contenders}
            for name, f in contenders.items():  # warm-up
                f()
            for _ in range(rounds):
                for name, f in contenders.items():
                    times[name].append(timed(f, device))
            row = dict(op=op, phase=phase, baseline=baseline,
                       **{f"{name}_ms": statistics.median(t) for name, t in times.items()})
            if "compiled_ms" in row:
                row["lite_over_compiled"] = row["mmcv-lite_ms"] / row["compiled_ms"]
            results.append(row)
            print(_row(row), flush=True)
    return results


def bench_train_step(device, rounds, compiled):
    """One loss + backward of the toy Mask R-CNN at 192 x 192, batch 2, each ``_ext`` in turn."""
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmdet.registry import MODELS
    from mmdet.testing import demo_mm_inputs

    cfg = Config.fromfile(TOY_DET)
    with DefaultScope.overwrite_default_scope("mmdet"):
        model = MODELS.build(cfg.model)
    model.to(device).train()
    batch = demo_mm_inputs(2, [(3, 192, 192)] * 2, num_items=[4, 3], num_classes=3, with_mask=True)
    data = model.data_preprocessor(batch, True)

    def step():
        losses = model.loss(data["inputs"], data["data_samples"])
        total = sum(v for k, v in losses.items() if "loss" in k and isinstance(v, torch.Tensor))
        total.backward()
        model.zero_grad(set_to_none=True)

    contenders = {"mmcv-lite": lite}
    if compiled is not None:
        contenders["compiled"] = compiled
    times = {name: [] for name in contenders}
    for r in range(rounds + 1):
        for name, ext in contenders.items():
            torch.manual_seed(r)
            with bound_to(ext):
                t = timed(step, device)
            if r:  # the first round warms up
                times[name].append(t)
    row = dict(op="toy Mask R-CNN train step (2 x 192 x 192)", phase="loss + backward",
               baseline="compiled mmcv" if compiled is not None else "not installed",
               **{f"{name}_ms": statistics.median(t) for name, t in times.items()})
    if "compiled_ms" in row:
        row["lite_over_compiled"] = row["mmcv-lite_ms"] / row["compiled_ms"]
    print(_row(row), flush=True)
    return row


def _row(row):
    lite_ms, comp = row["mmcv-lite_ms"], row.get("compiled_ms")
    ratio = f"{row['lite_over_compiled']:.2f}x" if comp else "-"
    comp_s = f"{comp:.2f} ms" if comp else "-"
    return f"| {row['op']} | {row['phase']} | {lite_ms:.2f} ms | {comp_s} | {ratio} | {row['baseline']} |"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per op, interleaved (default: 20)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="small sizes and a smoke run (for tests, not figures)")
    p.add_argument("--no-model", action="store_true", help="skip the toy Mask R-CNN training step")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds: expected a positive number of rounds, got {args.rounds}")
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    compiled = compiled_ext()
    import mmcv

    print(f"torch {torch.__version__}, torchvision {importlib.import_module('torchvision').__version__}, "
          f"mmcv {mmcv.__version__} ({'compiled ops' if compiled is not None else 'mmcv-lite: no compiled ops'}), "
          f"device {device}, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print("| op | phase | mmcv-lite | baseline | lite / baseline | baseline is |")
    print("|---|---|---|---|---|---|")
    rows = bench_ops(device, args.rounds, args.quick, compiled)
    if not args.no_model:
        rows.append(bench_train_step(device, max(2, args.rounds // 4), compiled))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, mmcv=mmcv.__version__, device=str(device),
                           threads=torch.get_num_threads(), compiled=compiled is not None, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
