"""Rows that the CPU run and the CUDA run share: the cost of image-exact batches, the Swin V2 rows
and a UPerNet (mmseg) training step."""
from __future__ import annotations

import statistics
from typing import List, Optional, Sequence, Tuple

import torch

from . import builders, memory
from .measure import interleave
from .report import summarize
from .steps import dtype_tag, eval_step, train_step


def padded_batch(size: Sequence[int], device: str) -> Tuple[torch.Tensor, List[Tuple[int, int]]]:
    """Two images of different sizes in one ``2 x 3 x H x W`` input, zero beyond each (as
    mmdet's / mmseg's padding), and their sizes ``(H, W - 17)``, ``(H - 50, W)``: one short on
    width, one on height, both cutting windows."""
    h, w = size
    sizes = [(h, w - 17), (h - 50, w)]
    x = torch.randn(2, 3, h, w, device=device)
    for image, (valid_h, valid_w) in zip(x, sizes):  # (narrow: a size too small for these cuts is an error)
        if valid_h < h:
            image.narrow(1, valid_h, h - valid_h).zero_()
        if valid_w < w:
            image.narrow(1, 0, valid_h).narrow(2, valid_w, w - valid_w).zero_()
    return x, sizes


def valid_sizes_overhead(model: torch.nn.Module, size: Sequence[int], device: str, iters: int, warmup: int,
                         autocast_dtype: Optional[torch.dtype] = None, train: bool = False) -> dict:
    """Cost of per-image valid sizes: a batch of 2 images of different sizes (:func:`padded_batch`),
    padded to one input, with ``valid_sizes`` against the same batch without, in the same
    interleaved rounds; eval, or (``train``) a training step; under autocast if given."""
    x, sizes = padded_batch(size, device)
    model.train(train)
    step = train_step if train else eval_step
    fns = {"without": step(model, x, autocast_dtype), "valid_sizes": step(model, x, autocast_dtype, valid_sizes=sizes)}
    times = interleave(fns, device, iters, warmup)
    overhead = statistics.median(v / w for v, w in zip(times["valid_sizes"], times["without"])) - 1
    med = {k: statistics.median(v) for k, v in times.items()}
    h, w = size
    kind = "train fwd+bwd" if train else "eval"
    tag = f" {dtype_tag(autocast_dtype)}" if autocast_dtype else ""
    print(f"valid_sizes overhead, {kind}{tag} 2x3x{h}x{w} (images {sizes[0][0]}x{sizes[0][1]}, "
          f"{sizes[1][0]}x{sizes[1][1]}): without {med['without'] * 1e3:.1f} ms, "
          f"with {med['valid_sizes'] * 1e3:.1f} ms, {100 * overhead:+.1f}%")
    return {"samples": times, "median_s": med, "overhead": overhead, "sizes": sizes}


def run_v2(args, results: dict, device: str, eval_size: Sequence[int], train_size: Sequence[int],
           evals: Sequence[tuple], trains: Sequence[Optional[torch.dtype]],
           memory_dtype: Optional[str] = None, fp32_tag: str = "fp32") -> None:
    """The Swin V2 rows (:func:`~.builders.build_v2`): eval at ``eval_size`` for every ``(batch, autocast
    dtype or None)`` of ``evals``, training fwd+bwd of 2 images at ``train_size`` for every
    autocast dtype (or None) of ``trains``, and peak training memory (``memory_dtype``), each
    as ratios of the same interleaved rounds. Keys ``v2_eval_{dtype}_{B}x3x{H}x{W}``,
    ``v2_train_{dtype}_2x3x{H}x{W}`` (``dtype``: ``fp32_tag`` without autocast) and
    ``v2_peak_memory``. The CPU run and the CUDA run differ only in the arguments."""
    models = builders.build_v2(device, eval_size, peers=not args.no_peers)
    reference = "timm" if "timm" in models else "ours"
    h, w = eval_size
    for batch, dtype in evals:
        x = torch.randn(batch, 3, h, w, device=device)
        for m in models.values():
            m.eval()
        tag = dtype_tag(dtype, fp32_tag)
        times = interleave({k: eval_step(m, x, dtype) for k, m in models.items()}, device, args.iters, args.warmup)
        results[f"v2_eval_{tag}_{batch}x3x{h}x{w}"] = summarize(f"Swin V2 eval {tag} {batch}x3x{h}x{w}", times,
                                                                reference)
    th, tw = train_size
    x = torch.randn(2, 3, th, tw, device=device)
    for dtype in trains:
        for m in models.values():
            m.train()
        tag = dtype_tag(dtype, fp32_tag)
        times = interleave({k: train_step(m, x, dtype) for k, m in models.items()}, device, args.iters, args.warmup)
        results[f"v2_train_{tag}_2x3x{th}x{tw}"] = summarize(f"Swin V2 train fwd+bwd {tag} 2x3x{th}x{tw}", times,
                                                             reference)
    if not args.skip_memory:
        mem = {k: memory.peak_memory("v2:" + k, device, 2, (th, tw), dtype=memory_dtype) for k in models}
        ratios = {k: mem["ours"] / v for k, v in mem.items() if k != "ours"}
        print(f"Swin V2 peak training memory {memory_dtype or 'fp32'} 2x3x{th}x{tw}: "
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in mem.items())
              + "".join(f"; ours / {k} {r:.2f}x" for k, r in ratios.items()))
        results["v2_peak_memory"] = {**{f"{k}_bytes": v for k, v in mem.items()},
                                     **{f"ratio_over_{k}": r for k, r in ratios.items()}}


def upernet_step(config: str, device: str, iters: int, warmup: int, size: int = 512, batch: int = 2) -> dict:
    """A UPerNet (mmseg) training step (loss + backward, bf16 autocast) of ``config``, with its
    SwinBackbone and with mmseg's own SwinTransformer of the same size, interleaved."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.structures import PixelData
    from mmseg.registry import MODELS
    from mmseg.structures import SegDataSample

    import swin_backbone  # noqa: F401  (registers SwinBackbone)

    init_default_scope("mmseg")
    cfg = Config.fromfile(config)
    model_cfg = cfg.model.copy()
    model_cfg.pop("data_preprocessor", None)
    model_cfg.backbone = dict(cfg.model.backbone, init_cfg=None, drop_path_rate=0.0)
    for head in ("decode_head", "auxiliary_head"):  # SyncBN needs a process group
        if head in model_cfg:
            model_cfg[head].norm_cfg = dict(type="BN", requires_grad=True)
    ours = MODELS.build(model_cfg)
    b = ours.backbone
    ref_cfg = model_cfg.copy()
    ref_cfg.backbone = dict(type="SwinTransformer", embed_dims=b.embed_dims, depths=b.depths, num_heads=b.num_heads,
                            window_size=b.window_size, out_indices=b.out_indices, drop_path_rate=0.0)
    built = {"mmseg": MODELS.build(ref_cfg).to(device).train(), "ours": ours.to(device).train()}
    x = torch.randn(batch, 3, size, size, device=device)
    num_classes = model_cfg.decode_head.num_classes
    samples = []
    for _ in range(batch):
        sample = SegDataSample()
        sample.gt_sem_seg = PixelData(data=torch.randint(0, num_classes, (1, size, size), device=device))
        sample.set_metainfo(dict(img_shape=(size, size), pad_shape=(size, size), ori_shape=(size, size)))
        samples.append(sample)

    def step(model):
        def run():
            with torch.autocast(device, dtype=torch.bfloat16):
                losses = model.loss(x, samples)
            sum(v for k, v in losses.items() if "loss" in k).backward()
            model.zero_grad(set_to_none=True)

        return run

    times = interleave({k: step(m) for k, m in built.items()}, device, iters, warmup)
    return summarize(f"UPerNet training step bf16 {batch}x3x{size}x{size}", times, reference="mmseg")
