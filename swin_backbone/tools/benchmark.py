#!/usr/bin/env python
"""SwinBackbone's speed on this machine against mmdet's SwinTransformer (the same weights), and
timm's and torchvision's Swin of the same size where installed, measured in the same run.

Two steps of each model: eval (one forward under inference mode) and training (forward and
backward in train mode, stochastic depth off), under autocast for ``--dtype bf16`` / ``fp16``;
on CUDA also the peak memory a training step allocates beyond the models and the input
(``torch.cuda.max_memory_allocated``). Each step runs its models in interleaved rounds (A B C A
B C ...) after ``--warmup`` rounds; a time is the median over ``--iters`` rounds, a speedup the
median of the per-round ratios (the models of a round run back to back, so a ratio is immune
to the machine's drift between rounds). Every peer library is optional: without mmdet the
ratios are against ours, and one line names what was skipped and how to install it.

    swin-benchmark [--arch tiny] [--device cuda|cpu] [--dtype fp32|bf16|fp16] [--size H W]
                   [--iters 9] [--warmup 2] [--no-peers] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..checkpoint.files import atomic_write
from ..model.presets import ARCH_SETTINGS
from .common import int_arg, one_line

#: The peer libraries compared with: module -> (what is skipped without it, how to install it).
PEERS: Dict[str, Tuple[str, str]] = {
    "mmdet": ("mmdet's SwinTransformer rows (the speedup reference and memory ratio; speedups are then over ours)",
              "pip install 'swin-backbone[mmdet]'"),
    "timm": ("timm's rows", "pip install timm"),
    "torchvision": ("torchvision's rows", "pip install torchvision"),
}
#: timm's and torchvision's Swin of each ``--arch`` (window 7, as ours and mmdet's here).
PEER_MODELS = {"tiny": ("swin_tiny_patch4_window7_224", "swin_t"), "small": ("swin_small_patch4_window7_224", "swin_s"),
               "base": ("swin_base_patch4_window7_224", "swin_b"), "large": ("swin_large_patch4_window7_224", None)}
#: ``--dtype`` -> the autocast dtype (``None``: fp32, no autocast).
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def installed(module: str) -> bool:
    """``module`` can be imported (checked without importing it)."""
    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------------- models
def build_pair(device: str, seed: int = 0, drop_path_rate: float = 0.0, arch: str = "tiny") -> Dict[str, torch.nn.Module]:
    """mmdet's SwinTransformer and ours (``arch``, window 7) with identical weights; without mmdet,
    ours alone (its own initialisation, seeded). Stochastic depth off unless ``drop_path_rate``."""
    from swin_backbone import SwinBackbone, load_checkpoint

    torch.manual_seed(seed)
    kwargs = dict(ARCH_SETTINGS[arch], window_size=7, drop_path_rate=drop_path_rate)
    if not installed("mmdet"):
        ours = SwinBackbone(arch=None, **kwargs)
        ours.init_weights()
        return {"ours": ours.to(device)}
    from mmdet.models.backbones import SwinTransformer

    ref = SwinTransformer(**kwargs)
    ref.init_weights()
    ours = SwinBackbone(arch=None, **kwargs)
    load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    return {"mmdet": ref.to(device), "ours": ours.to(device)}


def build_peers(device: str, size: Sequence[int], arch: str = "tiny",
                drop_path_rate: Optional[float] = None) -> Dict[str, torch.nn.Module]:
    """timm's and torchvision's Swin feature extractors of ``arch`` (random weights), where installed
    (and where the library has that size); ``drop_path_rate``: their stochastic depth (``None``:
    each library's default)."""
    timm_name, tv_name = PEER_MODELS[arch]
    rate = {} if drop_path_rate is None else {"drop_path_rate": drop_path_rate}
    peers: Dict[str, torch.nn.Module] = {}
    try:
        import timm

        peers["timm"] = timm.create_model(timm_name, pretrained=False, features_only=True, img_size=tuple(size),
                                          strict_img_size=False, **rate)
    except ImportError:
        pass
    try:
        import torchvision.models

        from torchvision.ops import StochasticDepth

        if tv_name is not None:
            peers["torchvision"] = getattr(torchvision.models, tv_name)(weights=None).features
            for m in peers["torchvision"].modules():
                if isinstance(m, StochasticDepth) and drop_path_rate is not None:
                    m.p = drop_path_rate
    except ImportError:
        pass
    return {k: m.to(device).eval() for k, m in peers.items()}


# ---------------------------------------------------------------------------------- steps
def _autocast(x: torch.Tensor, dtype: Optional[torch.dtype]):
    return torch.autocast(x.device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def eval_step(model, x, autocast_dtype=None, **kwargs) -> Callable[[], None]:
    """One forward of ``model(x, **kwargs)`` under inference mode (and autocast)."""
    def run():
        with torch.inference_mode(), _autocast(x, autocast_dtype):
            model(x, **kwargs)

    return run


def train_step(model, x, autocast_dtype=None, **kwargs) -> Callable[[], None]:
    """One forward of ``model(x, **kwargs)`` (autocast), the mean of its outputs' sum, backward."""
    def run():
        with _autocast(x, autocast_dtype):
            outs = model(x, **kwargs)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        loss = sum(o.float().mean() for o in outs)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


# ------------------------------------------------------------------------------ measuring
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str) -> float:
    """Seconds of one call of ``fn``, its kernels done."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleave(fns: Dict[str, Callable[[], None]], device: str, iters: int, warmup: int) -> Dict[str, List[float]]:
    """``warmup`` untimed rounds, then ``iters`` timed rounds, each one call of every step in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return times


def summarize(label: str, times: Dict[str, List[float]], reference: str = "mmdet") -> dict:
    """Medians of every model, and each one's speedup over ``reference`` (median of per-round ratios);
    ``reference`` not among them (mmdet not installed): over ours. Printed as one line."""
    reference = reference if reference in times else "ours"
    med = {k: statistics.median(v) for k, v in times.items()}
    speedups = {
        k: statistics.median(r / o for r, o in zip(times[reference], v)) for k, v in times.items() if k != reference
    }
    parts = [f"{k} {med[k] * 1e3:.1f} ms" + (f" ({speedups[k]:.2f}x)" if k in speedups else "") for k in times]
    print(f"{label}: " + ", ".join(parts) + f"  [speedup over {reference}]", flush=True)
    result = {"samples": times, "median_s": med, "speedup_over_" + reference: speedups}
    peers = [k for k in times if k not in ("ours", reference)]
    if "ours" in times and peers and reference != "ours":  # ours against every other model, per round as well
        ours_over = {k: statistics.median(p / o for p, o in zip(times[k], times["ours"])) for k in peers}
        print(f"{label}: ours faster than " + ", ".join(f"{k} {r:.2f}x" for k, r in ours_over.items()))
        result["ours_speedup_over"] = ours_over
    if "ours" in times and reference in times and reference != "ours":
        result.update(ours_s=med["ours"], mmdet_s=med[reference], speedup=speedups["ours"])
    return result


def step_peak_cuda(fn: Callable[[], None]) -> int:
    """Bytes of CUDA memory ``fn`` allocated at its peak above what was allocated before it (one
    call, in this process: the models stay resident, so only the step's own memory counts)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ---------------------------------------------------------------------------- the command
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line, checked: a usage error names the option, what it expects and what it
    got, and exits with status 2 before anything is built or timed."""
    parser = argparse.ArgumentParser(prog="swin-benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCH_SETTINGS), default="tiny", help="Swin size (default: tiny)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda where available")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="autocast dtype or fp32 (default: bf16 on cuda, "
                        "fp32 on cpu)")
    parser.add_argument("--size", type=int, nargs=2, metavar=("H", "W"),
                        help="input height and width, multiples of 4 (default: 800 1344 on cuda, 512 512 on cpu)")
    parser.add_argument("--eval-batch", type=int_arg(1), default=1, help="images per eval step (default: %(default)s)")
    parser.add_argument("--train-batch", type=int_arg(1), default=2,
                        help="images per training step (default: %(default)s)")
    parser.add_argument("--iters", type=int_arg(1), default=9, help="timed rounds (default: %(default)s)")
    parser.add_argument("--warmup", type=int_arg(0), default=2, help="untimed rounds first (default: %(default)s)")
    parser.add_argument("--no-peers", action="store_true", help="skip timm's and torchvision's models")
    parser.add_argument("--skip-memory", action="store_true", help="skip the CUDA peak-memory column")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: 'cuda' asked for, but CUDA is not available on this machine; expected --device cpu")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.size = args.size or ([800, 1344] if args.device == "cuda" else [512, 512])
    if min(args.size) < 4 or any(s % 4 for s in args.size):
        parser.error(f"--size: expected two multiples of 4 (the patch size), got {' '.join(map(str, args.size))}")
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        parser.error(f"--json: expected a file path in an existing folder, got {args.json!r}")
    return args


def run(args: argparse.Namespace) -> dict:
    """The measures of the module docstring; the results (also written to ``--json``)."""
    device, dtype, (h, w) = args.device, DTYPES[args.dtype], args.size
    machine = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"swin-benchmark: Swin {args.arch} on {machine}, torch {torch.__version__}, {args.dtype}")
    wanted = ["mmdet"] + ([] if args.no_peers else ["timm", "torchvision"])
    missing = [lib for lib in wanted if not installed(lib)]
    if missing:
        print("skipped (not installed): " + "; ".join(f"{PEERS[lib][0]}: {lib} ({PEERS[lib][1]})" for lib in missing))
    models = build_pair(device, arch=args.arch)
    if not args.no_peers:
        models.update(build_peers(device, args.size, args.arch, drop_path_rate=0.0))
    results: dict = dict(arch=args.arch, device=device, machine=machine, torch=torch.__version__, dtype=args.dtype,
                         size=[h, w], iters=args.iters, warmup=args.warmup, date=time.strftime("%Y-%m-%d"),
                         skipped=missing, versions={lib: getattr(sys.modules.get(lib), "__version__", None)
                                                    for lib in ("swin_backbone", "mmdet", "timm", "torchvision")})
    for kind, batch, step in (("eval", args.eval_batch, eval_step), ("train", args.train_batch, train_step)):
        x = torch.randn(batch, 3, h, w, device=device)
        for m in models.values():
            m.train(kind == "train")
        times = interleave({k: step(m, x, dtype) for k, m in models.items()}, device, args.iters, args.warmup)
        label = f"{'train fwd+bwd' if kind == 'train' else 'eval'} {args.dtype} {batch}x3x{h}x{w}"
        results[kind] = dict(summarize(label, times), label=label)
        if kind == "train" and device == "cuda" and not args.skip_memory:
            results["train_peak_bytes"] = {k: step_peak_cuda(step(m, x, dtype)) for k, m in models.items()}
    print("\n".join(table(results)))
    if args.json:
        atomic_write(args.json, (json.dumps(results, indent=2) + "\n").encode())
        print(f"wrote {args.json}")
    return results


def table(results: dict) -> List[str]:
    """The results as a table: per model, eval and training times with their speedup over the
    reference (mmdet, or ours without it), and on CUDA training peak memory with its ratio."""
    ref = "mmdet" if "mmdet" in results["eval"]["median_s"] else "ours"
    peaks = results.get("train_peak_bytes", {})
    head = ["model", f"{results['eval']['label']} ms", "speedup", f"{results['train']['label']} ms", "speedup"]
    head += ["train peak MiB", f"/ {ref}"] if peaks else []
    rows = []
    for name in results["eval"]["median_s"]:
        cells = [name]
        for kind in ("eval", "train"):
            row = results[kind]
            ratio = 1.0 if name == ref else row[f"speedup_over_{ref}"][name]
            cells += [f"{row['median_s'][name] * 1e3:.1f}", f"{ratio:.2f}x"]
        if peaks:
            cells += [f"{peaks[name] / 2**20:.0f}", f"{peaks[name] / max(peaks[ref], 1):.2f}x"]
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [" | ".join(c.ljust(n) if i == 0 else c.rjust(n) for i, (c, n) in enumerate(zip(r, widths)))
             for r in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return ["", *lines, f"speedup: {ref}'s time / the model's (median of the per-round ratios of {results['iters']} "
            f"interleaved rounds); times: medians" + (f"; peak memory / {ref}'s" if peaks else "")]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point (``swin-benchmark``): the exit status. 0: done (the table on
    stdout, the numbers in ``--json``); 2: a usage error; 1: a failure, in one line."""
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"swin-benchmark: error: {type(err).__name__}: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
