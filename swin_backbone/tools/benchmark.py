#!/usr/bin/env python
"""Speed and memory of SwinBackbone against mmdet 3.3's SwinTransformer (same weights) and
timm's / torchvision's Swin-T (same FLOPs, random weights), measured in the same run.

Every comparison runs its models in interleaved rounds (A B A B ...) after warm-up and reports
medians; a speedup is the median of the per-round ratios (both models run back to back in a
round, so the ratio is immune to the machine's drift between rounds).

CPU (default on a machine without CUDA):
  1. forward, eval, 1x3x800x1216 under inference_mode: ours, mmdet, timm, torchvision;
  2. forward + backward, train mode, 2x3x512x512: ours, mmdet;
  3. peak memory of (2) (peak RSS growth in a fresh subprocess per model);
  4. the backbone's FLOPs and achieved GFLOP/s of (1) against this machine's dense fp32 matmul
     rate (2048x2048 matmuls measured in the same rounds as (1)).
CUDA (``--device cuda``): eval bf16 1x and 8x 3x800x1344 and fp32 (TF32 off) 1x, training
fwd+bwd 2x3x800x1344 in bf16 and fp32, peak training memory, ``torch.compile`` (dynamic) of
eval and training, which SDPA kernels ran, and a UPerNet (mmseg) training step.
``--ablate`` turns each of SwinBackbone's optimisations off in turn (same weights, interleaved
rounds, one process; memory in subprocesses) and prints its effect on eval time, training time
and training peak memory; ``--ablate --v2`` then does the same for SwinV2Backbone (the V2
rows' model: tiny, window 8), ``--ablate --v2 only`` just that; ``--only WORD...`` picks
variants of both.

``--v2`` adds Swin V2 rows (``--v2 only``: just those): SwinV2Backbone tiny, window 8, against
timm's ``swinv2_tiny_window8_256`` (features_only, built for the eval size with
``strict_img_size=False``) and torchvision's ``swin_v2_t`` (its ``features``), all three with the
same weights (timm's random initialisation, loaded into ours by the checkpoint loader and
written for torchvision by our converter) and stochastic depth off: eval and training timings
as ratios from the same interleaved rounds, and peak training memory, on the CPU at the
sizes above and on CUDA with the V1 rows' dtypes and sizes. They take a few minutes on a
2-core CPU, so they are not part of the default run.

    python -m swin_backbone.tools.benchmark [--iters 9] [--json out.json] [--device cpu|cuda] [--v2 [only]]
    python -m swin_backbone.tools.benchmark --ablate [--v2 [only]] [--only WORD...] [--iters 9] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from swin_backbone import SwinBackbone, SwinV2Backbone, load_checkpoint, ops

ARCH = dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7)

#: ``--ablate`` variants: name -> planner switches (see swin_backbone.ops.planner.Switches).
ABLATIONS: Dict[str, Dict[str, object]] = {
    "no SDPA (matmul attention)": dict(sdpa=False),
    "no recompute attention (autograd)": dict(recompute_attention=False),
    "no memory-saving norm->linear/MLP": dict(save_memory=False),
    "no CPU row chunks": dict(chunk_bytes=0),
    "row chunks x0.5": dict(chunk_bytes="half"),
    "row chunks x2": dict(chunk_bytes="double"),
    "no masked-window fixup": dict(fixup_share=0.0),
    "fixup share 0.1 (default 0.25)": dict(fixup_share=0.1),
    "fixup share 0.5": dict(fixup_share=0.5),
}

#: ``--ablate --v2`` variants (names of :data:`ABLATIONS`): every one reaches SwinV2Backbone
#: through the same ``ops`` functions as V1. sdpa, recompute_attention and fixup_share:
#: ``WindowAttentionV2`` runs ``ops.window_attention`` (kernel and masked-window strategy of
#: the plan) on V1's stage layouts; save_memory: ``ops.norm_qkv`` (identity norm),
#: ``ops.cosine_qkv`` and ``ops.mlp_post_norm_residual``; chunk_bytes: the latter's inference
#: and training paths, the recompute attention's backward and ``ops.output_nchw``.
V2_ABLATIONS: Tuple[str, ...] = tuple(ABLATIONS)


def switches(name: Optional[str]) -> Dict[str, object]:
    """Planner overrides of an ablation variant (``None``: the defaults)."""
    if name is None:
        return {}
    if name not in ABLATIONS:
        raise ValueError(f"--ablate-variant: expected one of {sorted(ABLATIONS)}, got {name!r}")
    changes = dict(ABLATIONS[name])
    if changes.get("chunk_bytes") in ("half", "double"):
        base = ops.planner.cpu_chunk_bytes()
        changes["chunk_bytes"] = base // 2 if changes["chunk_bytes"] == "half" else base * 2
    return changes


def build_pair(device: str, seed: int = 0) -> Dict[str, torch.nn.Module]:
    """mmdet's SwinTransformer and ours (Swin-T) with identical weights."""
    from mmdet.models.backbones import SwinTransformer

    torch.manual_seed(seed)
    ref = SwinTransformer(**ARCH, drop_path_rate=0.0)
    ref.init_weights()
    ours = SwinBackbone(arch=None, **ARCH, drop_path_rate=0.0)
    load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    return {"mmdet": ref.to(device), "ours": ours.to(device)}


def build_peers(device: str, size: Sequence[int]) -> Dict[str, torch.nn.Module]:
    """timm's and torchvision's Swin-T feature extractors (random weights), where installed."""
    peers: Dict[str, torch.nn.Module] = {}
    try:
        import timm

        peers["timm"] = timm.create_model(
            "swin_tiny_patch4_window7_224", pretrained=False, features_only=True, img_size=tuple(size),
            strict_img_size=False,
        )
    except ImportError:
        pass
    try:
        from torchvision.models import swin_t

        peers["torchvision"] = swin_t(weights=None).features
    except ImportError:
        pass
    return {k: m.to(device).eval() for k, m in peers.items()}


#: timm's Swin V2 model that the V2 rows compare with (ours: ``SwinV2Backbone('tiny', window_size=8)``).
V2_TIMM = "swinv2_tiny_window8_256"


def build_v2(device: str, size: Sequence[int], peers: bool = True, seed: int = 0) -> Dict[str, torch.nn.Module]:
    """Swin V2-T window 8: ours, timm's (features_only, built for ``size``) and torchvision's
    ``swin_v2_t`` features, where installed, all with the same weights and no stochastic depth.

    The weights are timm's random initialisation: loaded into ours through the checkpoint
    loader (timm-v2 format; our stage 1-3 output norms, which a classification model lacks,
    stay unit LayerNorms) and into torchvision through our torchvision-v2 writer.
    """
    from swin_backbone.checkpoint.formats_v2 import ours_v2_to_torchvision

    torch.manual_seed(seed)
    ours = SwinV2Backbone("tiny", window_size=8, drop_path_rate=0.0)
    models: Dict[str, torch.nn.Module] = {"ours": ours}
    try:
        import timm
    except ImportError:
        timm = None
    if timm is not None:
        full = timm.create_model(V2_TIMM, pretrained=False, drop_path_rate=0.0)
        load_checkpoint(ours, full.state_dict(), logger=None)
        if peers:
            feats = timm.create_model(V2_TIMM, pretrained=False, features_only=True, img_size=tuple(size),
                                      strict_img_size=False, drop_path_rate=0.0)
            state = {k.replace("layers.", "layers_", 1): v for k, v in full.state_dict().items()
                     if k.startswith(("patch_embed.", "layers."))}
            feats.load_state_dict(state, strict=True)
            models["timm"] = feats
    else:
        ours.init_weights()
    if peers:
        try:
            from torchvision.models import swin_v2_t
            from torchvision.ops import StochasticDepth
        except ImportError:
            swin_v2_t = None
        if swin_v2_t is not None:
            tv = swin_v2_t(weights=None)
            _, unexpected = tv.load_state_dict(ours_v2_to_torchvision(ours.state_dict()), strict=False)
            if unexpected:
                raise RuntimeError(f"torchvision swin_v2_t: unexpected keys from our converter: {unexpected[:5]}")
            for m in tv.modules():
                if isinstance(m, StochasticDepth):
                    m.p = 0.0
            models["torchvision"] = tv.features
    return {k: m.to(device) for k, m in models.items()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleave(fns: Dict[str, Callable[[], None]], device: str, iters: int, warmup: int) -> Dict[str, List[float]]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return times


def with_switches(fn: Callable[[], None], changes: Dict[str, object]) -> Callable[[], None]:
    def run():
        with ops.override(**changes):
            fn()

    return run


def eval_step(model, x, autocast_dtype=None):
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        with torch.inference_mode(), ctx:
            model(x)

    return run


def train_step(model, x, autocast_dtype=None):
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        with ctx:
            outs = model(x)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        loss = sum(o.float().mean() for o in outs)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def count_flops(model, x) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(x)
    return counter.get_total_flops()


def matmul_step(device: str, n: int = 2048) -> Callable[[], None]:
    """Four dense fp32 ``n x n`` matmuls (``run.flops`` = ``8 n^3``): the attainable peak."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def run():
        for _ in range(4):
            a @ b

    run.flops = 4 * 2 * n**3  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------- memory
def memory_child(name: str, device: str, batch: int, size: Sequence[int], variant: Optional[str],
                 dtype: Optional[str]) -> None:
    """Run in a fresh process: peak memory of one fwd+bwd beyond the model and input."""
    if name.startswith("v2:"):  # a Swin V2 row's model
        name = name[3:]
        models = build_v2(device, size, peers=name != "ours")
    else:
        models = build_pair(device)
    model = models[name]
    model.train()  # (mmdet's train() returns None: no chaining)
    del models
    x = torch.randn(batch, 3, *size, device=device)
    step = with_switches(train_step(model, x, getattr(torch, dtype) if dtype else None), switches(variant))
    if device == "cuda":
        step()  # warm-up: cuBLAS / autotuning workspaces are not activations
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        import gc

        gc.collect()
        base = _reset_peak_rss()
        step()
        peak = _peak_rss() - base
    print(json.dumps({"peak_bytes": int(peak)}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0) and return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def _peak_rss() -> int:
    return _status_kb("VmHWM")


def peak_memory(name: str, device: str, batch: int, size: Sequence[int], variant: Optional[str] = None,
                dtype: Optional[str] = None) -> int:
    """Peak memory of one training step of ``name`` on ``batch x 3 x H x W``, in a fresh process."""
    cmd = [sys.executable, "-m", "swin_backbone.tools.benchmark", "--memory-child", name, "--device", device,
           "--batch", str(batch), "--memory-size", str(size[0]), str(size[1])]
    if variant:
        cmd += ["--ablate-variant", variant]
    if dtype:
        cmd += ["--memory-dtype", dtype]
    # Large blocks straight from / back to the OS (mmap), so RSS follows live tensors instead
    # of glibc's retained free memory.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


# ---------------------------------------------------------------------------- reporting
def summarize(label: str, times: Dict[str, List[float]], reference: str = "mmdet") -> dict:
    """Medians of every model, and each one's speedup over ``reference`` (median of per-round ratios)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    speedups = {
        k: statistics.median(r / o for r, o in zip(times[reference], v)) for k, v in times.items() if k != reference
    }
    parts = [f"{k} {med[k] * 1e3:.1f} ms" + (f" ({speedups[k]:.2f}x)" if k in speedups else "") for k in times]
    print(f"{label}: " + ", ".join(parts) + f"  [speedup over {reference}]")
    result = {"samples": times, "median_s": med, "speedup_over_" + reference: speedups}
    peers = [k for k in times if k not in ("ours", reference)]
    if "ours" in times and peers:  # ours against every other model, per round as well
        ours_over = {k: statistics.median(p / o for p, o in zip(times[k], times["ours"])) for k in peers}
        print(f"{label}: ours faster than " + ", ".join(f"{k} {r:.2f}x" for k, r in ours_over.items()))
        result["ours_speedup_over"] = ours_over
    if "ours" in times and reference in times and reference != "ours":  # the keys earlier runs and the tests read
        result.update(ours_s=med["ours"], mmdet_s=med[reference], speedup=speedups["ours"])
    return result


# ---------------------------------------------------------------------------- runs
def run_cpu(args, results: dict) -> None:
    device = "cpu"
    models = build_pair(device)
    eh, ew = args.eval_size
    ts = args.train_size
    x_eval = torch.randn(1, 3, eh, ew, device=device)
    for m in models.values():
        m.eval()
    peers = {} if args.no_peers else build_peers(device, (eh, ew))
    # The matmul ceiling is measured in the same rounds, so it sees the same machine state.
    matmul = matmul_step(device)
    fns = {**{k: eval_step(m, x_eval) for k, m in {**models, **peers}.items()}, "matmul": matmul}
    times = interleave(fns, device, args.iters, args.warmup)
    matmul_times = times.pop("matmul")
    eval_times = times
    results["forward_eval"] = summarize(f"forward eval 1x3x{eh}x{ew}", eval_times)

    x_train = torch.randn(2, 3, ts, ts, device=device)
    for m in models.values():
        m.train()
    times = interleave({k: train_step(m, x_train) for k, m in models.items()}, device, args.iters, args.warmup)
    results["forward_backward"] = summarize(f"forward+backward train 2x3x{ts}x{ts}", times)

    if not args.skip_memory:
        mem = {k: peak_memory(k, device, 2, (ts, ts)) for k in models}
        ratio = mem["ours"] / mem["mmdet"]
        print(f"peak memory fwd+bwd 2x3x{ts}x{ts}: ours {mem['ours'] / 2**20:.0f} MiB, "
              f"mmdet {mem['mmdet'] / 2**20:.0f} MiB, ratio {ratio:.2f}x")
        results["peak_memory"] = {"ours_bytes": mem["ours"], "mmdet_bytes": mem["mmdet"], "ratio": ratio}

    models["ours"].eval()
    flops = count_flops(models["ours"], x_eval)
    achieved = [flops / t / 1e9 for t in eval_times["ours"]]
    ceiling = [matmul.flops / t / 1e9 for t in matmul_times]  # type: ignore[attr-defined]
    fraction = statistics.median(a / c for a, c in zip(achieved, ceiling))
    print(f"FLOPs 1x3x{eh}x{ew}: {flops / 1e9:.1f} GFLOP; achieved {statistics.median(achieved):.0f} GFLOP/s "
          f"= {100 * fraction:.0f}% of the dense fp32 matmul ceiling ({statistics.median(ceiling):.0f} GFLOP/s, "
          f"2048x2048 matmuls measured in the same rounds)")
    results["flops"] = {"gflop": flops / 1e9, "achieved_gflops": statistics.median(achieved),
                        "matmul_gflops": statistics.median(ceiling), "fraction_of_ceiling": fraction}
    run_valid_sizes_overhead(models["ours"], args, results)
    if args.upernet:
        results["upernet_train_bf16"] = upernet_step(args.upernet, device, args.iters, args.warmup, args.upernet_size)


def run_cpu_v2(args, results: dict) -> None:
    """The Swin V2 rows on the CPU: eval 1x3xHxW and training 2x3xSxS in fp32 (the V1 rows' sizes)."""
    ts = args.train_size
    run_v2(args, results, "cpu", args.eval_size, (ts, ts), evals=[(1, None)], trains=[None])


def run_valid_sizes_overhead(model: torch.nn.Module, args, results: dict) -> None:
    """Eval cost of per-image valid sizes: a batch of 2 images of different sizes at detection
    resolution, padded to one input, with ``valid_sizes`` against the same batch without."""
    eh, ew = args.eval_size
    device = next(model.parameters()).device.type
    x = torch.randn(2, 3, eh, ew, device=device)
    sizes = [(eh, ew - 17), (eh - 50, ew)]  # one short on width, one on height: both cut windows
    for b, (h, w) in enumerate(sizes):  # zeros beyond each image, as mmdet's / mmseg's padding
        x[b, :, h:] = 0
        x[b, :, :, w:] = 0
    model.eval()

    def with_sizes():
        with torch.inference_mode():
            model(x, valid_sizes=sizes)

    times = interleave({"without": eval_step(model, x), "valid_sizes": with_sizes}, device, args.iters, args.warmup)
    overhead = statistics.median(v / w for v, w in zip(times["valid_sizes"], times["without"])) - 1
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"valid_sizes overhead, eval 2x3x{eh}x{ew} (images {sizes[0][0]}x{sizes[0][1]}, {sizes[1][0]}x{sizes[1][1]}): "
          f"without {med['without'] * 1e3:.1f} ms, with {med['valid_sizes'] * 1e3:.1f} ms, {100 * overhead:+.1f}%")
    results["valid_sizes_overhead"] = {"samples": times, "median_s": med, "overhead": overhead, "sizes": sizes}


def run_v2(args, results: dict, device: str, eval_size: Sequence[int], train_size: Sequence[int],
           evals: Sequence[tuple], trains: Sequence[Optional[torch.dtype]],
           memory_dtype: Optional[str] = None) -> None:
    """The Swin V2 rows (:func:`build_v2`): eval at ``eval_size`` for every ``(batch, autocast
    dtype or None)`` of ``evals``, training fwd+bwd of 2 images at ``train_size`` for every
    autocast dtype (or None) of ``trains``, and peak training memory (``memory_dtype``), each
    as ratios of the same interleaved rounds. Keys ``v2_eval_{dtype}_{B}x3x{H}x{W}``,
    ``v2_train_{dtype}_2x3x{H}x{W}`` and ``v2_peak_memory``. The CPU run and the CUDA run
    differ only in the arguments."""
    models = build_v2(device, eval_size, peers=not args.no_peers)
    reference = "timm" if "timm" in models else "ours"
    h, w = eval_size
    for batch, dtype in evals:
        x = torch.randn(batch, 3, h, w, device=device)
        for m in models.values():
            m.eval()
        tag = _dtype_tag(dtype)
        times = interleave({k: eval_step(m, x, dtype) for k, m in models.items()}, device, args.iters, args.warmup)
        results[f"v2_eval_{tag}_{batch}x3x{h}x{w}"] = summarize(f"Swin V2 eval {tag} {batch}x3x{h}x{w}", times,
                                                                reference)
    th, tw = train_size
    x = torch.randn(2, 3, th, tw, device=device)
    for dtype in trains:
        for m in models.values():
            m.train()
        tag = _dtype_tag(dtype)
        times = interleave({k: train_step(m, x, dtype) for k, m in models.items()}, device, args.iters, args.warmup)
        results[f"v2_train_{tag}_2x3x{th}x{tw}"] = summarize(f"Swin V2 train fwd+bwd {tag} 2x3x{th}x{tw}", times,
                                                             reference)
    if not args.skip_memory:
        mem = {k: peak_memory("v2:" + k, device, 2, (th, tw), dtype=memory_dtype) for k in models}
        ratios = {k: mem["ours"] / v for k, v in mem.items() if k != "ours"}
        print(f"Swin V2 peak training memory {memory_dtype or 'fp32'} 2x3x{th}x{tw}: "
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in mem.items())
              + "".join(f"; ours / {k} {r:.2f}x" for k, r in ratios.items()))
        results["v2_peak_memory"] = {**{f"{k}_bytes": v for k, v in mem.items()},
                                     **{f"ratio_over_{k}": r for k, r in ratios.items()}}


def _dtype_tag(dtype: Optional[torch.dtype]) -> str:
    return "fp32" if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def ablation_variants(names: Sequence[str], only: Optional[Sequence[str]]) -> List[str]:
    """The variants of ``names`` whose name contains a word of ``--only`` (all of them without it)."""
    chosen = list(names) if not only else [name for name in names if any(o in name for o in only)]
    if only and not chosen:
        raise ValueError(f"--only: expected words of the variant names {sorted(names)}, got {only}")
    return chosen


def run_ablations(args, results: dict) -> None:
    """``--ablate``: the ablation of SwinBackbone (Swin-T, key ``ablation``), and with ``--v2``
    that of SwinV2Backbone (:func:`build_v2`'s "ours", key ``v2_ablation``; ``--v2 only``: just
    that), each with the variants ``--only`` chose."""
    device = args.device
    v1 = ablation_variants(ABLATIONS, args.only) if args.v2 != "only" else None
    v2 = ablation_variants(V2_ABLATIONS, args.only) if args.v2 else None  # (checked before anything runs)
    if v1 is not None:
        run_ablation(args, results, build_pair(device)["ours"], v1)
    if v2 is not None:
        run_ablation(args, results, build_v2(device, args.eval_size, peers=False)["ours"], v2, memory_name="v2:ours",
                     key="v2_ablation", title="Swin V2 ablation of SwinV2Backbone tiny, window 8")


def run_ablation(args, results: dict, model: torch.nn.Module, chosen: Sequence[str], memory_name: str = "ours",
                 key: str = "ablation", title: str = "ablation") -> None:
    """Each optimisation of ``chosen`` (names of :data:`ABLATIONS`) off in turn against the
    defaults, for ``model``: eval, training and memory effects (memory: of ``memory_name``'s
    model in :func:`memory_child`), printed under ``title`` and stored as ``results[key]``."""
    device = args.device
    eh, ew = args.eval_size
    ts = args.train_size
    x_eval = torch.randn(1, 3, eh, ew, device=device)
    x_train = torch.randn(2, 3, ts, ts, device=device)
    variants: List[Optional[str]] = [None, *chosen]
    label = {v: v or "defaults" for v in variants}
    model.eval()
    eval_times = interleave({label[v]: with_switches(eval_step(model, x_eval), switches(v)) for v in variants},
                            device, args.iters, args.warmup)
    model.train()
    train_times = interleave({label[v]: with_switches(train_step(model, x_train), switches(v)) for v in variants},
                             device, args.iters, args.warmup)
    memory = {} if args.skip_memory else {label[v]: peak_memory(memory_name, device, 2, (ts, ts), v)
                                           for v in variants}
    base = "defaults"
    rows = {}
    print(f"\n{title} (each optimisation off; effect = time or memory without it / with it - 1; "
          f"eval 1x3x{eh}x{ew}, train 2x3x{ts}x{ts}, {args.iters} interleaved rounds)")
    print(f"{'variant':40s} {'eval':>9s} {'train':>9s} {'memory':>9s}")
    for v in variants:
        name = label[v]
        row = {
            "eval_s": statistics.median(eval_times[name]),
            "train_s": statistics.median(train_times[name]),
            "eval_effect": statistics.median(t / b for t, b in zip(eval_times[name], eval_times[base])) - 1,
            "train_effect": statistics.median(t / b for t, b in zip(train_times[name], train_times[base])) - 1,
        }
        if memory:
            row["peak_bytes"] = memory[name]
            row["memory_effect"] = memory[name] / memory[base] - 1
        rows[name] = row
        mem = f"{100 * row['memory_effect']:+8.1f}%" if memory else "       -"
        if v is None:
            mem = f"{memory[name] / 2**20:7.0f}MB" if memory else mem
            print(f"{name:40s} {row['eval_s'] * 1e3:7.0f}ms {row['train_s'] * 1e3:7.0f}ms {mem}")
        else:
            print(f"{name:40s} {100 * row['eval_effect']:+8.1f}% {100 * row['train_effect']:+8.1f}% {mem}")
    results[key] = {"eval_size": [eh, ew], "train_size": ts, "rows": rows,
                    "samples": {"eval": eval_times, "train": train_times}}


def sdpa_kernels(model, x, autocast_dtype, train: bool) -> List[str]:
    """Names of the SDPA kernels one forward (and backward) runs."""
    from torch.profiler import profile

    with profile() as prof:
        (train_step if train else eval_step)(model, x, autocast_dtype)()
    sync(x.device.type)
    return sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "attention" in e.key.lower()})


#: Input size of the CUDA rows.
CUDA_SIZE = (800, 1344)


def run_cuda(args, results: dict) -> None:
    device = "cuda"
    results["gpu"] = torch.cuda.get_device_name()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    h, w = CUDA_SIZE
    models = build_pair(device)
    peers = {} if args.no_peers else build_peers(device, (h, w))
    everyone = {**models, **peers}
    bf16 = torch.bfloat16
    for batch, dtype in ((1, bf16), (8, bf16), (1, None)):
        x = torch.randn(batch, 3, h, w, device=device)
        for m in everyone.values():
            m.eval()
        tag = "bf16" if dtype else "fp32"
        times = interleave({k: eval_step(m, x, dtype) for k, m in everyone.items()}, device, args.iters, args.warmup)
        results[f"eval_{tag}_{batch}x3x{h}x{w}"] = summarize(f"eval {tag} {batch}x3x{h}x{w}", times)
    x = torch.randn(2, 3, h, w, device=device)
    for dtype in (bf16, None):
        for m in everyone.values():
            m.train()
        tag = "bf16" if dtype else "fp32"
        times = interleave({k: train_step(m, x, dtype) for k, m in everyone.items()}, device, args.iters, args.warmup)
        results[f"train_{tag}_2x3x{h}x{w}"] = summarize(f"train fwd+bwd {tag} 2x3x{h}x{w}", times)
    if not args.skip_memory:
        mem = {k: peak_memory(k, device, 2, (h, w), dtype="bfloat16") for k in models}
        print(f"peak training memory bf16 2x3x{h}x{w}: ours {mem['ours'] / 2**20:.0f} MiB, "
              f"mmdet {mem['mmdet'] / 2**20:.0f} MiB, ratio {mem['ours'] / mem['mmdet']:.2f}x")
        results["peak_memory"] = {"ours_bytes": mem["ours"], "mmdet_bytes": mem["mmdet"],
                                  "ratio": mem["ours"] / mem["mmdet"]}
    ours = models["ours"]
    results["sdpa_kernels"] = {
        "eval_bf16": sdpa_kernels(ours.eval(), torch.randn(1, 3, h, w, device=device), bf16, False),
        "train_bf16": sdpa_kernels(ours.train(), torch.randn(2, 3, h, w, device=device), bf16, True),
        "train_fp32": sdpa_kernels(ours.train(), torch.randn(2, 3, h, w, device=device), None, True),
    }
    print("attention kernels that ran:", json.dumps(results["sdpa_kernels"]))
    if args.compile:
        compiled = {k: torch.compile(m, dynamic=True) for k, m in models.items()}
        x8 = torch.randn(8, 3, h, w, device=device)
        for m in compiled.values():
            m.eval()
        times = interleave({k: eval_step(m, x8, bf16) for k, m in compiled.items()}, device, args.iters, args.warmup)
        results[f"compiled_eval_bf16_8x3x{h}x{w}"] = summarize(f"torch.compile eval bf16 8x3x{h}x{w}", times)
        for m in compiled.values():
            m.train()
        times = interleave({k: train_step(m, x, bf16) for k, m in compiled.items()}, device, args.iters, args.warmup)
        results[f"compiled_train_bf16_2x3x{h}x{w}"] = summarize(f"torch.compile train bf16 2x3x{h}x{w}", times)
    if args.upernet:
        results["upernet_train_bf16"] = upernet_step(args.upernet, device, args.iters, args.warmup)


def run_cuda_v2(args, results: dict, size: Sequence[int] = CUDA_SIZE) -> None:
    """The Swin V2 rows on CUDA, as the V1 rows of :func:`run_cuda`: eval bf16 1x and 8x and fp32
    (TF32 off) 1x, training 2x in bf16 and fp32, peak training memory in bf16."""
    if torch.cuda.is_available():
        results.setdefault("gpu", torch.cuda.get_device_name())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    bf16 = torch.bfloat16
    run_v2(args, results, args.device, size, size, evals=[(1, bf16), (8, bf16), (1, None)], trains=[bf16, None],
           memory_dtype="bfloat16")


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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--no-peers", action="store_true", help="skip the timm / torchvision rows")
    parser.add_argument("--ablate", action="store_true",
                        help="only the ablation of SwinBackbone's optimisations (with --v2: then SwinV2Backbone's; "
                        "--v2 only: just SwinV2Backbone's)")
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="--ablate: only the variants whose name contains a WORD (V1 and V2)")
    parser.add_argument("--eval-size", type=int, nargs=2, default=(800, 1216), metavar=("H", "W"))
    parser.add_argument("--train-size", type=int, default=512, help="train images are 2 x 3 x S x S")
    parser.add_argument("--compile", action="store_true", help="CUDA: add torch.compile rows (minutes of compiling)")
    parser.add_argument("--upernet", metavar="CONFIG", help="a UPerNet training step of this mmseg config")
    parser.add_argument("--v2", nargs="?", const="also", choices=("also", "only"),
                        help="add the Swin V2 rows (ours vs timm / torchvision, same weights; minutes on a "
                        "2-core CPU); '--v2 only': just those; with --ablate: SwinV2Backbone's ablation too (or only)")
    parser.add_argument("--upernet-size", type=int, default=512, help="CPU: its input is 2 x 3 x S x S")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--ablate-variant", help=argparse.SUPPRESS)
    parser.add_argument("--memory-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--memory-size", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.device, args.batch, args.memory_size, args.ablate_variant,
                     args.memory_dtype)
        return {}

    results: dict = {"device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d")}
    print(f"device {args.device}, torch {torch.__version__}" + (
        f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f", {torch.get_num_threads()} threads"))
    if args.ablate:
        run_ablations(args, results)
    else:
        cuda = args.device == "cuda"
        if args.v2 != "only":
            (run_cuda if cuda else run_cpu)(args, results)
        if args.v2:
            (run_cuda_v2 if cuda else run_cpu_v2)(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
