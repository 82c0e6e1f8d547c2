#!/usr/bin/env python
"""Speed and memory of SwinBackbone against mmdet 3.3's SwinTransformer (same weights) and
timm's / torchvision's Swin-T (same FLOPs, random weights), measured in the same run.

Every comparison runs its models in interleaved rounds (A B A B ...) after warm-up and reports
medians; a speedup is the median of the per-round ratios (both models run back to back in a
round, so the ratio is immune to the machine's drift between rounds).

Every peer library is optional (a plain ``pip install swin-backbone`` has none): rows time what is
installed, speedups are over ours where mmdet is missing, ``--ablate`` needs none, and one line
says which comparisons were skipped and what to install for them.

CPU (default on a machine without CUDA):
  1. forward, eval, 1x3x800x1216 under inference_mode: ours, mmdet, timm, torchvision;
  2. forward + backward, train mode, 2x3x512x512: ours, mmdet;
  3. peak memory of (2) (peak RSS growth in a fresh subprocess per model);
  4. the backbone's FLOPs and achieved GFLOP/s of (1) against this machine's dense fp32 matmul
     rate (2048x2048 matmuls measured in the same rounds as (1));
  5. the eval cost of image-exact batches: 2 zero-padded images of different sizes with
     ``valid_sizes`` against the same batch without.
CUDA (``--device cuda``), input 3x800x1344, all models (ours, mmdet, timm, torchvision) in each
row unless said otherwise:
  1. eval: bf16 autocast 1x and 8x (torch's TF32 defaults: bf16 matmuls ignore them), fp32 1x
     with TF32 off (``fp32-ieee``: cuBLAS matmuls and cuDNN convolutions in full fp32) and
     with TF32 on (``fp32-tf32``, what most users run; set and restored through
     ``fp32_precision`` where torch has it, else ``allow_tf32``);
  2. training fwd+bwd 2x: bf16, fp32-ieee and fp32-tf32;
  3. peak training memory bf16 2x: ours, mmdet (a fresh process each, after the parent
     returned its cached CUDA memory);
  4. the cost of image-exact batches: SwinBackbone eval and training, bf16, on 2 zero-padded
     images (HxW-17 and H-50xW) with ``valid_sizes`` against the same batch without;
  5. which attention ran (one profiled step each: eval bf16 with and without ``valid_sizes``,
     training bf16 and fp32-ieee): SDPA's kernels, SDPA calls, launches of the fused Triton
     window-attention kernel, and the ``constant_pad_nd`` / ``copy_`` ops (all, and inside
     SDPA calls: the fused CUDA kernels' copies of masks whose rows are not 8-aligned);
  6. ``--compile``: ``torch.compile`` (dynamic) eval bf16 8x and training bf16 2x of mmdet,
     ours, and ours with the opt-in fused Triton kernel (``ours_triton``: a copy with the same
     weights and ``attention='triton'``: the kernel kept in the graph as a custom operator),
     with (5) for both of ours; eval
     bf16 1x with ``mode="reduce-overhead"`` (CUDA graphs) of mmdet and ours against both
     eager in the same rounds; ``--compile only``: just these (a device call of its own);
  7. ``--upernet CONFIG``: a UPerNet (mmseg) training step, bf16.
Each timed row is ``--warmup`` + ``--iters`` rounds of one step of each of its models (the
CUDA-graph row: at least 3 warm-up rounds); ``--json`` is rewritten as each row finishes, so a
run cut short keeps the rows it finished.
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
sizes above and on CUDA with the V1 rows' sizes, in bf16 and fp32-ieee. They take a few minutes on a
2-core CPU, so they are not part of the default run.

    python -m swin_backbone.tools.benchmark [--iters 9] [--json out.json] [--device cpu|cuda] [--v2 [only]]
    python -m swin_backbone.tools.benchmark --ablate [--v2 [only]] [--only WORD...] [--iters 9] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from swin_backbone import SwinBackbone, SwinV2Backbone, load_checkpoint, ops
from swin_backbone.torch_compat import has_fp32_precision

ARCH = dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7)

#: ``--ablate`` variants: name -> planner switches (see swin_backbone.ops.planner.Switches).
ABLATIONS: Dict[str, Dict[str, object]] = {
    "no SDPA (matmul attention)": dict(sdpa=False),
    "no recompute attention (autograd)": dict(recompute_attention=False),
    "no selective checkpointing of the MLP": dict(save_memory=False),
    "no CPU row chunks": dict(chunk_bytes=0),
    "row chunks x0.5": dict(chunk_bytes="half"),
    "row chunks x2": dict(chunk_bytes="double"),
}

#: ``--ablate --v2`` variants (names of :data:`ABLATIONS`): every one reaches SwinV2Backbone
#: through the same ``ops`` functions as V1. sdpa and recompute_attention: ``WindowAttentionV2``
#: runs ``ops.window_attention`` (the plan's kernel) on V1's stage layouts; save_memory:
#: ``ops.cosine_qkv`` and ``ops.mlp_residual`` (norm after); chunk_bytes: the latter's inference
#: path, the recompute attention's backward and ``ops.output_nchw``.
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


#: The peer libraries the rows compare with (none is needed: a plain install times ours alone):
#: module -> (what is skipped without it, how to install it).
PEERS: Dict[str, Tuple[str, str]] = {
    "mmdet": ("mmdet's SwinTransformer rows (the speedup reference and memory ratio; speedups are then over ours)",
              "pip install 'swin-backbone[mmdet]'"),
    "timm": ("timm's rows (and the Swin V2 rows' reference weights)", "pip install timm"),
    "torchvision": ("torchvision's rows", "pip install torchvision"),
    "mmseg": ("--upernet (an mmseg UPerNet)", "pip install 'swin-backbone[mmseg]'"),
}


def installed(module: str) -> bool:
    """``module`` can be imported (checked without importing it)."""
    return importlib.util.find_spec(module) is not None


def skipped_peers(args: argparse.Namespace) -> List[str]:
    """The peer libraries this run's rows would use that are not installed."""
    if args.ablate or args.memory_child:
        return []  # ours alone
    wanted = ["mmdet"] if args.v2 != "only" else []
    if not args.no_peers:
        wanted += ["timm", "torchvision"]
    elif args.v2:
        wanted.append("timm")  # the V2 rows' weights
    if args.upernet:
        wanted.append("mmseg")
    return [lib for lib in wanted if not installed(lib)]


def build_pair(device: str, seed: int = 0) -> Dict[str, torch.nn.Module]:
    """mmdet's SwinTransformer and ours (Swin-T) with identical weights; without mmdet, ours
    alone (its own initialisation, seeded)."""
    torch.manual_seed(seed)
    if not installed("mmdet"):
        ours = SwinBackbone(arch=None, **ARCH, drop_path_rate=0.0)
        ours.init_weights()
        return {"ours": ours.to(device)}
    from mmdet.models.backbones import SwinTransformer

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
    """``fn`` run under the planner overrides ``changes`` (see :func:`ops.override`)."""
    def run():
        with ops.override(**changes):
            fn()

    return run


def _tf32_flags() -> List[Tuple[object, str, object, object]]:
    """``(namespace, attribute, on, off)`` of torch's TF32 switches for fp32 cuBLAS matmuls and
    cuDNN convolutions: ``fp32_precision`` ('tf32' / 'ieee') where torch has it (on torch >= 2.9
    reading or writing the legacy ``allow_tf32`` raises once ``fp32_precision`` was set), else
    ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    conv = getattr(torch.backends.cudnn, "conv", None)
    return [
        (matmul, "fp32_precision", "tf32", "ieee") if has_fp32_precision(matmul)
        else (matmul, "allow_tf32", True, False),
        (conv, "fp32_precision", "tf32", "ieee") if conv is not None and has_fp32_precision(conv)
        else (torch.backends.cudnn, "allow_tf32", True, False),
    ]


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 for fp32 matmuls and convolutions on or off (CUDA; flags only elsewhere), restored on exit."""
    flags = _tf32_flags()
    saved = [getattr(ns, name) for ns, name, _, _ in flags]
    try:
        for ns, name, on, off in flags:
            setattr(ns, name, on if enabled else off)
        yield
    finally:
        for (ns, name, _, _), value in zip(flags, saved):
            setattr(ns, name, value)


def compile_model(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """``torch.compile(model, **kwargs)`` (one place, so a test can stand in for it on a CPU)."""
    return torch.compile(model, **kwargs)


def eval_step(model, x, autocast_dtype=None, **kwargs):
    """One forward of ``model(x, **kwargs)`` under inference mode (and autocast)."""
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            model(x, **kwargs)

    return run


def train_step(model, x, autocast_dtype=None, **kwargs):
    """One forward of ``model(x, **kwargs)`` (autocast), the mean of its outputs' sum, backward."""
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with ctx:
            outs = model(x, **kwargs)
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
    """Peak memory of one training step of ``name`` on ``batch x 3 x H x W``, in a fresh process
    (on CUDA after this process returned its cached blocks, which would compete for the GPU)."""
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
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
    """Medians of every model, and each one's speedup over ``reference`` (median of per-round ratios);
    ``reference`` not among them (mmdet not installed): over ours."""
    reference = reference if reference in times else "ours"
    med = {k: statistics.median(v) for k, v in times.items()}
    speedups = {
        k: statistics.median(r / o for r, o in zip(times[reference], v)) for k, v in times.items() if k != reference
    }
    parts = [f"{k} {med[k] * 1e3:.1f} ms" + (f" ({speedups[k]:.2f}x)" if k in speedups else "") for k in times]
    print(f"{label}: " + ", ".join(parts) + f"  [speedup over {reference}]")
    result = {"samples": times, "median_s": med, "speedup_over_" + reference: speedups}
    peers = [k for k in times if k not in ("ours", reference)]
    if "ours" in times and peers and reference != "ours":  # ours against every other model, per round as well
        ours_over = {k: statistics.median(p / o for p, o in zip(times[k], times["ours"])) for k in peers}
        print(f"{label}: ours faster than " + ", ".join(f"{k} {r:.2f}x" for k, r in ours_over.items()))
        result["ours_speedup_over"] = ours_over
    if "ours" in times and reference in times and reference != "ours":  # the keys earlier runs and the tests read
        result.update(ours_s=med["ours"], mmdet_s=med[reference], speedup=speedups["ours"])
    return result


def memory_row(label: str, mem: Dict[str, int]) -> dict:
    """Print and return the peak-memory row: ours, and mmdet's with the ratio where it ran."""
    if "mmdet" not in mem:
        print(f"{label}: ours {mem['ours'] / 2**20:.0f} MiB")
        return {"ours_bytes": mem["ours"]}
    ratio = mem["ours"] / mem["mmdet"]
    print(f"{label}: ours {mem['ours'] / 2**20:.0f} MiB, mmdet {mem['mmdet'] / 2**20:.0f} MiB, ratio {ratio:.2f}x")
    return {"ours_bytes": mem["ours"], "mmdet_bytes": mem["mmdet"], "ratio": ratio}


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
        results["peak_memory"] = memory_row(f"peak memory fwd+bwd 2x3x{ts}x{ts}", mem)

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
    """CPU: the eval cost of per-image valid sizes at the eval size (:func:`valid_sizes_overhead`)."""
    device = next(model.parameters()).device.type
    results["valid_sizes_overhead"] = valid_sizes_overhead(model, args.eval_size, device, args.iters, args.warmup)


def padded_batch(size: Sequence[int], device: str) -> Tuple[torch.Tensor, List[Tuple[int, int]]]:
    """Two images of different sizes in one ``2 x 3 x H x W`` input, zero beyond each (as
    mmdet's / mmseg's padding), and their sizes ``(H, W - 17)``, ``(H - 50, W)``: one short on
    width, one on height, both cutting windows."""
    h, w = size
    sizes = [(h, w - 17), (h - 50, w)]
    return ops.image_sizes.zero_beyond_valid(torch.randn(2, 3, h, w, device=device), sizes, 2, inplace=True), sizes


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
    tag = f" {_dtype_tag(autocast_dtype)}" if autocast_dtype else ""
    print(f"valid_sizes overhead, {kind}{tag} 2x3x{h}x{w} (images {sizes[0][0]}x{sizes[0][1]}, "
          f"{sizes[1][0]}x{sizes[1][1]}): without {med['without'] * 1e3:.1f} ms, "
          f"with {med['valid_sizes'] * 1e3:.1f} ms, {100 * overhead:+.1f}%")
    return {"samples": times, "median_s": med, "overhead": overhead, "sizes": sizes}


def run_v2(args, results: dict, device: str, eval_size: Sequence[int], train_size: Sequence[int],
           evals: Sequence[tuple], trains: Sequence[Optional[torch.dtype]],
           memory_dtype: Optional[str] = None, fp32_tag: str = "fp32") -> None:
    """The Swin V2 rows (:func:`build_v2`): eval at ``eval_size`` for every ``(batch, autocast
    dtype or None)`` of ``evals``, training fwd+bwd of 2 images at ``train_size`` for every
    autocast dtype (or None) of ``trains``, and peak training memory (``memory_dtype``), each
    as ratios of the same interleaved rounds. Keys ``v2_eval_{dtype}_{B}x3x{H}x{W}``,
    ``v2_train_{dtype}_2x3x{H}x{W}`` (``dtype``: ``fp32_tag`` without autocast) and
    ``v2_peak_memory``. The CPU run and the CUDA run differ only in the arguments."""
    models = build_v2(device, eval_size, peers=not args.no_peers)
    reference = "timm" if "timm" in models else "ours"
    h, w = eval_size
    for batch, dtype in evals:
        x = torch.randn(batch, 3, h, w, device=device)
        for m in models.values():
            m.eval()
        tag = _dtype_tag(dtype, fp32_tag)
        times = interleave({k: eval_step(m, x, dtype) for k, m in models.items()}, device, args.iters, args.warmup)
        results[f"v2_eval_{tag}_{batch}x3x{h}x{w}"] = summarize(f"Swin V2 eval {tag} {batch}x3x{h}x{w}", times,
                                                                reference)
    th, tw = train_size
    x = torch.randn(2, 3, th, tw, device=device)
    for dtype in trains:
        for m in models.values():
            m.train()
        tag = _dtype_tag(dtype, fp32_tag)
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


def _dtype_tag(dtype: Optional[torch.dtype], fp32: str = "fp32") -> str:
    """A row's dtype in its key and label: ``fp32`` (no autocast) or the autocast dtype's."""
    return fp32 if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


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


def sdpa_kernels(model, x, autocast_dtype, train: bool, changes: Optional[Dict[str, object]] = None,
                 **kwargs) -> dict:
    """Which attention one forward (``train``: one forward + backward) of ``model(x, **kwargs)``
    ran, under the planner overrides ``changes``, from one torch.profiler run:

    * ``kernels``: names of the SDPA / attention ops and kernels;
    * ``sdpa_calls``: SDPA calls (forward backend ops ``aten::_scaled_dot_product_*``: one per
      call, also where a compiled graph calls a backend directly);
    * ``triton_window_attention_launches``: GPU launches of the fused Triton window-attention
      kernel; ``inductor_triton_launches``: of inductor's Triton kernels (``triton_*``);
    * ``constant_pad_nd`` / ``copy_``: those ops in the whole step, and ``*_in_sdpa``: inside
      SDPA calls (the fused CUDA kernels copy a mask whose non-last strides are not multiples
      of 8 on every call; nested ops count too: a pad's own copy is also a copy).
    """
    from torch.autograd import DeviceType
    from torch.profiler import profile

    step = with_switches((train_step if train else eval_step)(model, x, autocast_dtype, **kwargs), changes or {})
    with profile() as prof:
        step()
        sync(x.device.type)
    events = prof.events()
    counts = {"constant_pad_nd": 0, "copy_": 0, "constant_pad_nd_in_sdpa": 0, "copy_in_sdpa": 0}
    for e in events:
        if e.name in ("aten::constant_pad_nd", "aten::copy_"):
            op = e.name[len("aten::"):]
            counts[op] += 1
            parent = e.cpu_parent
            while parent is not None and "scaled_dot_product" not in parent.name:
                parent = parent.cpu_parent
            counts[op.rstrip("_") + "_in_sdpa"] += parent is not None
    on_device = [e.name for e in events if e.device_type != DeviceType.CPU]
    names = {e.key for e in prof.key_averages()}
    return {
        "step": "forward+backward" if train else "forward",
        "kernels": sorted(n for n in names if "scaled_dot_product" in n or "attention" in n.lower()
                          or n.startswith(("fmha", "flash"))),
        "sdpa_calls": sum(e.name.startswith("aten::_scaled_dot_product_") and not e.name.endswith("_backward")
                          for e in events),
        "triton_window_attention_launches": sum("_window_attention_kernel" in n for n in on_device),
        "inductor_triton_launches": sum(n.startswith("triton_") for n in on_device),
        **counts,
    }


#: Input size of the CUDA rows.
CUDA_SIZE = (800, 1344)


def _precision_tag(dtype: Optional[torch.dtype], allow_tf32: Optional[bool]) -> str:
    """A CUDA row's precision in its key and label: ``bf16``, ``fp32-ieee`` (TF32 off) or ``fp32-tf32``."""
    if dtype is not None or allow_tf32 is None:
        return _dtype_tag(dtype)
    return "fp32-tf32" if allow_tf32 else "fp32-ieee"


def _tf32_or_as_set(allow_tf32: Optional[bool]):
    """:func:`tf32` on or off, or (``None``) torch's settings as they are."""
    return contextlib.nullcontext() if allow_tf32 is None else tf32(allow_tf32)


def run_cuda(args, results: dict, size: Sequence[int] = CUDA_SIZE) -> None:
    """The CUDA rows of the module docstring on ``args.device`` at ``size`` (the tests run them
    on the CPU at tiny sizes: the TF32 switches are flags only there). Keys
    ``{eval,train}_{bf16,fp32-ieee,fp32-tf32}_{B}x3x{H}x{W}`` (fp32 rows: ``tf32`` says which),
    ``peak_memory``, ``valid_sizes_overhead_{eval,train}_bf16_2x3x{H}x{W}``, ``sdpa_kernels``,
    ``compiled_*`` (:func:`run_compiled`) and ``upernet_train_bf16``."""
    device = args.device
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    h, w = size
    models = build_pair(device)
    if args.compile == "only":  # a device call of its own (compiling takes minutes)
        run_compiled(args, results, models, size)
        return
    peers = {} if args.no_peers else build_peers(device, (h, w))
    everyone = {**models, **peers}
    bf16 = torch.bfloat16
    # (batch, autocast dtype, TF32): None leaves torch's settings (bf16 matmuls ignore them).
    # Each row: warmup + iters rounds of one step of every model.
    rows = [("eval", 1, bf16, None), ("eval", 8, bf16, None), ("eval", 1, None, False), ("eval", 1, None, True),
            ("train", 2, bf16, None), ("train", 2, None, False), ("train", 2, None, True)]
    for kind, batch, dtype, allow in rows:
        x = torch.randn(batch, 3, h, w, device=device)
        step, label = (train_step, "train fwd+bwd") if kind == "train" else (eval_step, "eval")
        for m in everyone.values():
            m.train(kind == "train")
        tag = _precision_tag(dtype, allow)
        with _tf32_or_as_set(allow):
            times = interleave({k: step(m, x, dtype) for k, m in everyone.items()}, device, args.iters, args.warmup)
        row = summarize(f"{label} {tag} {batch}x3x{h}x{w}", times)
        results[f"{kind}_{tag}_{batch}x3x{h}x{w}"] = row if allow is None else {**row, "tf32": allow}
    if not args.skip_memory:
        mem = {k: peak_memory(k, device, 2, (h, w), dtype="bfloat16") for k in models}
        results["peak_memory"] = memory_row(f"peak training memory bf16 2x3x{h}x{w}", mem)
    ours = models["ours"]
    # Image-exact batches: warmup + iters rounds of 2 steps (with and without) per row.
    for train in (False, True):
        kind = "train" if train else "eval"
        results[f"valid_sizes_overhead_{kind}_bf16_2x3x{h}x{w}"] = valid_sizes_overhead(
            ours, size, device, args.iters, args.warmup, bf16, train)
    x_padded, sizes = padded_batch(size, device)
    with tf32(False):
        results["sdpa_kernels"] = {  # one profiled step each
            "eval_bf16": sdpa_kernels(ours.eval(), torch.randn(1, 3, h, w, device=device), bf16, False),
            "eval_bf16_valid_sizes": sdpa_kernels(ours.eval(), x_padded, bf16, False, valid_sizes=sizes),
            "train_bf16": sdpa_kernels(ours.train(), torch.randn(2, 3, h, w, device=device), bf16, True),
            "train_fp32-ieee": sdpa_kernels(ours.train(), torch.randn(2, 3, h, w, device=device), None, True),
        }
    if args.compile:
        run_compiled(args, results, models, size)
    print("attention that ran:", json.dumps(results["sdpa_kernels"]))
    if args.upernet:
        results["upernet_train_bf16"] = upernet_step(args.upernet, device, args.iters, args.warmup)


def _allow_recompiles(limit: int = 32) -> None:
    """Raise dynamo's recompile limit per function (default 8): :func:`run_compiled` traces
    SwinBackbone's forward in 5 variants (eval / training, with / without the Triton kernel,
    CUDA graphs) besides any a caller compiled; past the limit dynamo would run it eagerly."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def _cudagraph_skips() -> int:
    """How often inductor has so far declined to use CUDA graphs for a compiled graph."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def run_compiled(args, results: dict, models: Dict[str, torch.nn.Module], size: Sequence[int]) -> None:
    """``--compile`` rows of ``models`` (mmdet, ours) at ``size``, bf16 autocast:

    * ``compiled_eval_bf16_8x3x{H}x{W}``, ``compiled_train_bf16_2x3x{H}x{W}``: ``torch.compile``
      (dynamic) of mmdet, ours (SDPA) and ``ours_triton`` (a copy of ours, same weights, with
      ``attention='triton'``: the opt-in fused kernel as a custom operator in the graph), one
      step each per round (warmup + iters rounds);
    * ``sdpa_kernels["compiled_{eval,train}_bf16[_triton]"]``: which attention ran in both;
    * ``compiled_reduce_overhead_eval_bf16_1x3x{H}x{W}``: eval 1x with
      ``mode="reduce-overhead"`` (CUDA graphs, one input size) of mmdet and ours, and both
      eager (``*_eager``), in the same rounds; ``cudagraph_skips``: compiled graphs that
      inductor ran without CUDA graphs.
    """
    device = args.device
    h, w = size
    bf16 = torch.bfloat16
    _allow_recompiles()
    # The opt-in fused kernel: a copy of ours with attention='triton' (a module of its own: it
    # shares no guards / caches with "ours").
    twin = copy.deepcopy(models["ours"])
    twin.attention = "triton"
    compiled = {k: compile_model(m, dynamic=True) for k, m in {**models, "ours_triton": twin}.items()}
    changes: Dict[str, Dict[str, object]] = {k: {} for k in compiled}
    x8 = torch.randn(8, 3, h, w, device=device)
    x2 = torch.randn(2, 3, h, w, device=device)
    for m in compiled.values():
        m.eval()
    times = interleave({k: with_switches(eval_step(m, x8, bf16), changes[k]) for k, m in compiled.items()}, device,
                       args.iters, args.warmup)
    results[f"compiled_eval_bf16_8x3x{h}x{w}"] = summarize(f"torch.compile eval bf16 8x3x{h}x{w}", times)
    for m in compiled.values():
        m.train()
    times = interleave({k: with_switches(train_step(m, x2, bf16), changes[k]) for k, m in compiled.items()}, device,
                       args.iters, args.warmup)
    results[f"compiled_train_bf16_2x3x{h}x{w}"] = summarize(f"torch.compile train bf16 2x3x{h}x{w}", times)
    kernels = results.setdefault("sdpa_kernels", {})  # (no eager rows with --compile only)
    for name, suffix in (("ours", ""), ("ours_triton", "_triton")):  # the timed shapes: no recompiles
        m = compiled[name]
        kernels[f"compiled_eval_bf16{suffix}"] = sdpa_kernels(m.eval(), x8, bf16, False, changes[name])
        kernels[f"compiled_train_bf16{suffix}"] = sdpa_kernels(m.train(), x2, bf16, True, changes[name])
    # Batch-1 eval is launch-bound on a GPU: CUDA graphs replay a whole forward in one launch.
    graphed = {k: compile_model(m, mode="reduce-overhead", dynamic=False) for k, m in models.items()}
    for m in models.values():
        m.eval()
    x1 = torch.randn(1, 3, h, w, device=device)
    fns = {k: eval_step(m, x1, bf16) for k, m in graphed.items()}
    fns.update({f"{k}_eager": eval_step(m, x1, bf16) for k, m in models.items()})
    skips = _cudagraph_skips()
    # CUDA graph trees record on a call after the compiling one and replay from the next: 3 warm-up rounds at least.
    times = interleave(fns, device, args.iters, max(args.warmup, 3))
    row = summarize(f"torch.compile reduce-overhead eval bf16 1x3x{h}x{w}", times)
    results[f"compiled_reduce_overhead_eval_bf16_1x3x{h}x{w}"] = {**row, "cudagraph_skips": _cudagraph_skips() - skips}
    torch._dynamo.reset()  # frees the compiled graphs and CUDA graph pools before the rows that follow


def run_cuda_v2(args, results: dict, size: Sequence[int] = CUDA_SIZE) -> None:
    """The Swin V2 rows on CUDA, as the V1 rows of :func:`run_cuda`: eval bf16 1x and 8x and
    fp32-ieee (TF32 off, restored after) 1x, training 2x in bf16 and fp32-ieee, peak training
    memory in bf16."""
    if torch.cuda.is_available():
        results.setdefault("gpu", torch.cuda.get_device_name())
    bf16 = torch.bfloat16
    with tf32(False):
        run_v2(args, results, args.device, size, size, evals=[(1, bf16), (8, bf16), (1, None)], trains=[bf16, None],
               memory_dtype="bfloat16", fp32_tag="fp32-ieee")


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


class SavedResults(dict):
    """The results, rewritten to ``path`` (JSON) whenever a row is added: a run cut short (a
    time limit) keeps the rows it finished."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self, f, indent=2)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):  # never leave a half-written file behind
                os.remove(tmp)
            raise


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (:func:`check_args`): usage errors exit with status 2."""
    parser = argparse.ArgumentParser(prog="swin-benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the CPU rows or the CUDA rows (default: cuda where available)")
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
    parser.add_argument("--compile", nargs="?", const="also", choices=("also", "only"),
                        help="CUDA: add torch.compile rows (minutes of compiling); '--compile only': just those")
    parser.add_argument("--upernet", metavar="CONFIG", help="a UPerNet training step of this mmseg config")
    parser.add_argument("--report", action="store_true",
                        help="with --device cuda: first the GPU report (machine, versions, every attention kernel "
                             "verified and timed at Swin-T / Swin-B shapes), then the rows")
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
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option checked before anything is built or timed: the error names the option,
    what it expects and what it got."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: 'cuda' asked for, but CUDA is not available on this machine; expected --device cpu")
    for option, value, low in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                               ("--train-size", args.train_size, 1), ("--upernet-size", args.upernet_size, 1),
                               ("--batch", args.batch, 1)):
        if value < low:
            parser.error(f"{option}: expected an int >= {low}, got {value}")
    for option, size in (("--eval-size", args.eval_size), ("--memory-size", args.memory_size)):
        if size is not None and min(size) < 1:
            parser.error(f"{option}: expected two sizes H W >= 1, got {' '.join(map(str, size))}")
    if args.memory_child:
        return  # the benchmark's own subprocess
    if args.only and not args.ablate:
        parser.error("--only: picks --ablate variants; expected it with --ablate")
    if args.ablate:
        try:
            names = (ABLATIONS if args.v2 != "only" else {}).keys() | (set(V2_ABLATIONS) if args.v2 else set())
            ablation_variants(sorted(names), args.only)
        except ValueError as err:
            parser.error(str(err))
    if args.report and args.device != "cuda":
        parser.error(f"--report: the GPU report; expected it with --device cuda, got --device {args.device}")
    if args.compile and args.device != "cuda":
        parser.error("--compile: the torch.compile rows are CUDA rows; expected it with --device cuda")
    if args.upernet and "::" not in args.upernet and not os.path.isfile(args.upernet):  # (mmseg::...: a package's)
        parser.error(f"--upernet: no such config file {args.upernet!r}")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(folder):
            parser.error(f"--json: expected a file path in an existing folder, got {args.json!r}")


def run(args: argparse.Namespace) -> dict:
    """The benchmark the parsed ``args`` ask for; its results (also written to ``--json``)."""
    if args.memory_child:
        memory_child(args.memory_child, args.device, args.batch, args.memory_size, args.ablate_variant,
                     args.memory_dtype)
        return {}

    results: dict = SavedResults(args.json) if args.json else {}
    results.update(device=args.device, threads=torch.get_num_threads(), torch=torch.__version__,
                   date=time.strftime("%Y-%m-%d"))
    print(f"device {args.device}, torch {torch.__version__}" + (
        f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f", {torch.get_num_threads()} threads"))
    missing = skipped_peers(args)
    if missing:  # a plain install: ours alone, said in one line
        print("skipped (not installed): " + "; ".join(f"{PEERS[lib][0]}: {lib} ({PEERS[lib][1]})" for lib in missing))
        if "mmseg" in missing:
            args.upernet = None
    if args.report:
        from .gpu_report import report

        results.update(gpu_report=report())
    if args.ablate:
        run_ablations(args, results)
    else:
        cuda = args.device == "cuda"
        if args.v2 != "only":
            (run_cuda if cuda else run_cpu)(args, results)
        if args.v2:
            (run_cuda_v2 if cuda else run_cpu_v2)(args, results)
    if args.json:
        results.save()
        print(f"wrote {args.json}")
    return dict(results)


def main(argv=None) -> int:
    """Command-line entry point (``swin-benchmark``): the exit status. 0: done (the rows as
    lines on stdout, the numbers in ``--json``); 2: a usage error; 1: a failure, in one line."""
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError, RuntimeError, subprocess.CalledProcessError) as err:
        text = " ".join(str(err).split())
        print(f"swin-benchmark: error: {type(err).__name__}: {text}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
