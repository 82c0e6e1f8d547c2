#!/usr/bin/env python
"""The developer benchmark (``make bench``; outside the wheel, whose ``swin-benchmark`` is the
short user command): speed and memory of SwinBackbone against mmdet 3.3's SwinTransformer (same weights) and
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
     ``valid_sizes`` against the same batch without;
  6. ``--compile`` (``only``: just these): (1) and (2) in fp32 of ours eager, ours in its
     compiled mode (``compile=True``), mmdet eager and ``torch.compile`` of mmdet, with the
     first (compiling) call's time.
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
     training bf16 and fp32-ieee): SDPA's kernels, SDPA calls, inductor's Triton launches,
     and the ``constant_pad_nd`` / ``copy_`` ops (all, and inside SDPA calls: the fused CUDA
     kernels' copies of masks whose rows are not 8-aligned);
  6. ``--compile``: ``torch.compile`` (dynamic) eval bf16 8x and training bf16 2x of mmdet and
     ours, and ours in its compiled mode (``compile=True``: its regions compiled), with the
     first (compiling) call's time, with (5) for ours; eval bf16 1x with ``mode="reduce-overhead"`` (CUDA graphs) of
     mmdet and ours against both eager in the same rounds; ``--compile only``: just these (a
     device call of its own);
  7. ``--upernet CONFIG``: a UPerNet (mmseg) training step, bf16.
``--padded`` adds, on either device (bf16 on CUDA), eval and training of a padded detection
batch: an 800x1333 landscape beside a 1333x800 portrait (``--padded-size``), zero-padded to
2x3x1344x1344 (41% padding), mmdet on the batch, ours with ``valid_sizes`` and ours without, in
the same rounds (``--padded only``: just these; on a 2-core CPU they take many minutes).
``tools/analysis_tools/gpu_report.py`` is the prepared GPU run: a chosen set of these
rows within minutes, as JSON and as the table of docs/performance.md.
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

    python tools/analysis_tools/benchmark.py [--iters 9] [--json out.json] [--device cpu|cuda] [--v2 [only]]
    python tools/analysis_tools/benchmark.py --padded only [--iters 5] [--json out.json]
    python tools/analysis_tools/benchmark.py --ablate [--v2 [only]] [--only WORD...] [--iters 9] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarking.py beside it

import benchmarking as B  # noqa: E402  (puts the checkout's package on the path)
from benchmarking import (PEERS, dtype_tag, eval_step, interleave, memory_row, summarize, tf32, timed,  # noqa: E402
                          train_step, with_switches)

from swin_backbone import ops  # noqa: E402
from swin_backbone.tools.common import one_line  # noqa: E402

PROG = "tools/analysis_tools/benchmark.py"


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
    if args.padded == "only":
        wanted = ["mmdet"]
    return [lib for lib in wanted if not B.installed(lib)]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (:func:`check_args`): usage errors exit with status 2."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
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
                        help="add torch.compile rows (minutes of compiling); '--compile only': just those")
    parser.add_argument("--upernet", metavar="CONFIG", help="a UPerNet training step of this mmseg config")
    parser.add_argument("--report", action="store_true",
                        help="with --device cuda: first the GPU report (the card, the driver and the versions), then "
                             "the rows")
    parser.add_argument("--v2", nargs="?", const="also", choices=("also", "only"),
                        help="add the Swin V2 rows (ours vs timm / torchvision, same weights; minutes on a "
                        "2-core CPU); '--v2 only': just those; with --ablate: SwinV2Backbone's ablation too (or only)")
    parser.add_argument("--upernet-size", type=int, default=512, help="CPU: its input is 2 x 3 x S x S")
    parser.add_argument("--padded", nargs="?", const="also", choices=("also", "only"),
                        help="add the padded-batch rows (a landscape and a portrait image in one batch: mmdet, ours "
                        "with and without valid_sizes); '--padded only': just those")
    parser.add_argument("--padded-size", type=int, nargs=2, default=PADDED_IMAGE, metavar=("H", "W"),
                        help="--padded's landscape image (the portrait is W x H; default: %(default)s)")
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
    for option, size in (("--eval-size", args.eval_size), ("--memory-size", args.memory_size),
                         ("--padded-size", args.padded_size)):
        if size is not None and min(size) < 1:
            parser.error(f"{option}: expected two sizes H W >= 1, got {' '.join(map(str, size))}")
    if args.memory_child:
        return  # the benchmark's own subprocess
    if args.only and not args.ablate:
        parser.error("--only: picks --ablate variants; expected it with --ablate")
    if args.ablate:
        try:
            names = ((ABLATIONS if args.v2 != "only" else {}).keys()
                     | (set(V2_ABLATIONS) if args.v2 else set()))
            ablation_variants(sorted(names), args.only)
        except ValueError as err:
            parser.error(str(err))
    if args.padded and (args.ablate or args.v2 == "only"):
        parser.error(f"--padded: rows of the V1 run; not with {'--ablate' if args.ablate else '--v2 only'}")
    if args.compile and (args.ablate or args.v2 == "only"):
        parser.error(f"--compile: rows of the V1 run; not with {'--ablate' if args.ablate else '--v2 only'}")
    if args.report and args.device != "cuda":
        parser.error(f"--report: the GPU report; expected it with --device cuda, got --device {args.device}")
    if args.upernet and "::" not in args.upernet and not os.path.isfile(args.upernet):  # (mmseg::...: a package's)
        parser.error(f"--upernet: no such config file {args.upernet!r}")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(folder):
            parser.error(f"--json: expected a file path in an existing folder, got {args.json!r}")


def run(args: argparse.Namespace) -> dict:
    """The benchmark the parsed ``args`` ask for; its results (also written to ``--json``)."""
    if args.memory_child:
        B.memory_child(args.memory_child, args.device, args.batch, args.memory_size,
                            switches(args.ablate_variant), args.memory_dtype)
        return {}

    results: dict = B.SavedResults(args.json) if args.json else {}
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
        results.update(environment=B.environment())
        print("environment: " + ", ".join(f"{k} {v}" for k, v in results["environment"].items()))
    cuda = args.device == "cuda"
    if args.ablate:
        run_ablations(args, results)
    elif args.padded == "only":
        run_padded(args, results, B.build_pair(args.device), torch.bfloat16 if cuda else None)
    else:
        if args.v2 != "only":
            (run_cuda if cuda else run_cpu)(args, results)
        if args.v2:
            (run_cuda_v2 if cuda else run_cpu_v2)(args, results)
    if args.json:
        results.save()
        print(f"wrote {args.json}")
    return dict(results)




# -------------------------------------------------------------------------------- CPU run
def run_cpu(args, results: dict) -> None:
    device = "cpu"
    models = B.build_pair(device)
    if args.compile == "only":
        run_compiled_cpu(args, results, models)
        return
    eh, ew = args.eval_size
    ts = args.train_size
    x_eval = torch.randn(1, 3, eh, ew, device=device)
    for m in models.values():
        m.eval()
    peers = {} if args.no_peers else B.build_peers(device, (eh, ew))
    # The matmul ceiling is measured in the same rounds, so it sees the same machine state.
    matmul = B.matmul_step(device)
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
        mem = {k: B.peak_memory(k, device, 2, (ts, ts)) for k in models}
        results["peak_memory"] = memory_row(f"peak memory fwd+bwd 2x3x{ts}x{ts}", mem)

    models["ours"].eval()
    flops = B.count_flops(models["ours"], x_eval)
    achieved = [flops / t / 1e9 for t in eval_times["ours"]]
    ceiling = [matmul.flops / t / 1e9 for t in matmul_times]  # type: ignore[attr-defined]
    fraction = statistics.median(a / c for a, c in zip(achieved, ceiling))
    print(f"FLOPs 1x3x{eh}x{ew}: {flops / 1e9:.1f} GFLOP; achieved {statistics.median(achieved):.0f} GFLOP/s "
          f"= {100 * fraction:.0f}% of the dense fp32 matmul ceiling ({statistics.median(ceiling):.0f} GFLOP/s, "
          f"2048x2048 matmuls measured in the same rounds)")
    results["flops"] = {"gflop": flops / 1e9, "achieved_gflops": statistics.median(achieved),
                        "matmul_gflops": statistics.median(ceiling), "fraction_of_ceiling": fraction}
    run_valid_sizes_overhead(models["ours"], args, results)
    if args.padded:
        run_padded(args, results, models)
    if args.upernet:
        results["upernet_train_bf16"] = upernet_step(args.upernet, device, args.iters, args.warmup, args.upernet_size)
    if args.compile:
        run_compiled_cpu(args, results, models)


def compiled_row(label: str, fns: Dict[str, Callable[[], None]], device: str, args) -> dict:
    """A ``--compile`` row: each step's first call timed on its own (``first_call_s``: the
    compiled ones compile in it), then ``--warmup`` + ``--iters`` interleaved rounds, summarised."""
    first = {k: timed(fn, device) for k, fn in fns.items()}
    times = interleave(fns, device, args.iters, args.warmup)
    row = summarize(label, times)
    print("  first call (compiling): " + ", ".join(f"{k} {v:.1f} s" for k, v in first.items()))
    return {**row, "first_call_s": first}


def run_compiled_cpu(args, results: dict, models: Dict[str, torch.nn.Module]) -> None:
    """CPU ``--compile`` rows, fp32: ``compiled_forward_eval`` (1x ``--eval-size``) and
    ``compiled_forward_backward`` (2x ``--train-size``) of ours eager, ours in its compiled mode
    (``ours_regional``: ``compile=True``, its regions compiled), mmdet eager and ``torch.compile``
    of mmdet with static shapes (``mmdet_compiled``; with ``dynamic=True`` inductor's CPU code
    generation did not finish its first eval forward in 20 minutes: docs/compiled-mode.md), in
    the same rounds; ``first_call_s``: each one's first call (the compiled ones compile in it)."""
    device = "cpu"
    _allow_recompiles()
    (eh, ew), ts = args.eval_size, args.train_size
    variants = {"ours": models["ours"], "ours_regional": B.regional_model(models["ours"])}
    if "mmdet" in models:
        variants.update(mmdet=models["mmdet"], mmdet_compiled=B.compile_model(models["mmdet"], dynamic=False))
    for key, x, step in (("compiled_forward_eval", torch.randn(1, 3, eh, ew), eval_step),
                         ("compiled_forward_backward", torch.randn(2, 3, ts, ts), train_step)):
        for m in variants.values():
            m.train(step is train_step)
        fns = {k: step(m, x) for k, m in variants.items()}
        results[key] = compiled_row(f"{key.replace('_', ' ')} {x.shape[0]}x3x{x.shape[2]}x{x.shape[3]}", fns,
                                    device, args)
    torch._dynamo.reset()


def run_cpu_v2(args, results: dict) -> None:
    """The Swin V2 rows on the CPU: eval 1x3xHxW and training 2x3xSxS in fp32 (the V1 rows' sizes)."""
    ts = args.train_size
    run_v2(args, results, "cpu", args.eval_size, (ts, ts), evals=[(1, None)], trains=[None])


def run_valid_sizes_overhead(model: torch.nn.Module, args, results: dict) -> None:
    """CPU: the eval cost of per-image valid sizes at the eval size (:func:`valid_sizes_overhead`)."""
    device = next(model.parameters()).device.type
    results["valid_sizes_overhead"] = valid_sizes_overhead(model, args.eval_size, device, args.iters, args.warmup)


# ------------------------------------------------------------------------------- CUDA run
#: Input size of the CUDA rows.
CUDA_SIZE = (800, 1344)


def _precision_tag(dtype: Optional[torch.dtype], allow_tf32: Optional[bool]) -> str:
    """A CUDA row's precision in its key and label: ``bf16``, ``fp32-ieee`` (TF32 off) or ``fp32-tf32``."""
    if dtype is not None or allow_tf32 is None:
        return dtype_tag(dtype)
    return "fp32-tf32" if allow_tf32 else "fp32-ieee"


def _tf32_or_as_set(allow_tf32: Optional[bool]):
    """:func:`tf32` on or off, or (``None``) torch's settings as they are."""
    return contextlib.nullcontext() if allow_tf32 is None else tf32(allow_tf32)


#: The CUDA run's timed rows: (eval / train, batch, autocast dtype, TF32). ``None`` for TF32
#: leaves torch's settings (bf16 matmuls ignore them).
CUDA_ROWS = [("eval", 1, torch.bfloat16, None), ("eval", 8, torch.bfloat16, None), ("eval", 1, None, False),
             ("eval", 1, None, True), ("train", 2, torch.bfloat16, None), ("train", 2, None, False),
             ("train", 2, None, True)]


def run_rows(args, results: dict, models: Dict[str, torch.nn.Module], rows: Sequence[tuple],
             size: Sequence[int]) -> None:
    """Each row of ``rows`` (as :data:`CUDA_ROWS`) for every model at ``size``: warmup + iters
    rounds of one step of each; keys ``{eval,train}_{bf16,fp32-ieee,fp32-tf32}_{B}x3x{H}x{W}``
    (fp32 rows: ``tf32`` says which)."""
    h, w = size
    for kind, batch, dtype, allow in rows:
        x = torch.randn(batch, 3, h, w, device=args.device)
        step, label = (train_step, "train fwd+bwd") if kind == "train" else (eval_step, "eval")
        for m in models.values():
            m.train(kind == "train")
        tag = _precision_tag(dtype, allow)
        with _tf32_or_as_set(allow):
            times = interleave({k: step(m, x, dtype) for k, m in models.items()}, args.device, args.iters,
                               args.warmup)
        row = summarize(f"{label} {tag} {batch}x3x{h}x{w}", times)
        results[f"{kind}_{tag}_{batch}x3x{h}x{w}"] = row if allow is None else {**row, "tf32": allow}


def run_cuda(args, results: dict, size: Sequence[int] = CUDA_SIZE) -> None:
    """The CUDA rows of the module docstring on ``args.device`` at ``size`` (the tests run them
    on the CPU at tiny sizes: the TF32 switches are flags only there). Keys of
    :func:`run_rows`, ``peak_memory``, ``valid_sizes_overhead_{eval,train}_bf16_2x3x{H}x{W}``,
    ``padded_*`` (:func:`run_padded`), ``sdpa_kernels``, ``compiled_*`` (:func:`run_compiled`)
    and ``upernet_train_bf16``."""
    device = args.device
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    h, w = size
    models = B.build_pair(device)
    if args.compile == "only":  # a device call of its own (compiling takes minutes)
        run_compiled(args, results, models, size)
        return
    peers = {} if args.no_peers else B.build_peers(device, (h, w))
    run_rows(args, results, {**models, **peers}, CUDA_ROWS, size)
    bf16 = torch.bfloat16
    if not args.skip_memory:
        mem = {k: B.peak_memory(k, device, 2, (h, w), dtype="bfloat16") for k in models}
        results["peak_memory"] = memory_row(f"peak training memory bf16 2x3x{h}x{w}", mem)
    ours = models["ours"]
    # Image-exact batches: warmup + iters rounds of 2 steps (with and without) per row.
    for train in (False, True):
        kind = "train" if train else "eval"
        results[f"valid_sizes_overhead_{kind}_bf16_2x3x{h}x{w}"] = valid_sizes_overhead(
            ours, size, device, args.iters, args.warmup, bf16, train)
    if args.padded:
        run_padded(args, results, models, bf16)
    x_padded, sizes = padded_batch(size, device)
    with tf32(False):
        results["sdpa_kernels"] = {  # one profiled step each
            "eval_bf16": B.sdpa_kernels(ours.eval(), torch.randn(1, 3, h, w, device=device), bf16, False),
            "eval_bf16_valid_sizes": B.sdpa_kernels(ours.eval(), x_padded, bf16, False, valid_sizes=sizes),
            "train_bf16": B.sdpa_kernels(ours.train(), torch.randn(2, 3, h, w, device=device), bf16, True),
            "train_fp32-ieee": B.sdpa_kernels(ours.train(), torch.randn(2, 3, h, w, device=device), None, True),
        }
    if args.compile:
        run_compiled(args, results, models, size)
    print("attention that ran:", json.dumps(results["sdpa_kernels"]))
    if args.upernet:
        results["upernet_train_bf16"] = upernet_step(args.upernet, device, args.iters, args.warmup)


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


# -------------------------------------------------------------------------- torch.compile
def _allow_recompiles(limit: int = 32) -> None:
    """Raise dynamo's recompile limit per function (default 8): :func:`run_compiled` traces
    SwinBackbone's forward in 3 variants (eval, training, CUDA graphs) besides any a caller
    compiled; past the limit dynamo would run it eagerly."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def cudagraph_skips() -> int:
    """How often inductor has so far declined to use CUDA graphs for a compiled graph."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def run_compiled(args, results: dict, models: Dict[str, torch.nn.Module], size: Sequence[int],
                 cuda_graphs: bool = True, whole_ours: bool = True, dynamic: bool = True) -> None:
    """``--compile`` rows of ``models`` (mmdet, ours) at ``size``, bf16 autocast:

    * ``compiled_eval_bf16_8x3x{H}x{W}``, ``compiled_train_bf16_2x3x{H}x{W}``: ``torch.compile``
      (dynamic) of each model, and ``ours_regional``: ours with ``compile=True`` (its blocks
      compiled), one step each per round (warmup + iters rounds); ``first_call_s``: each one's
      first call, which compiles;
    * ``sdpa_kernels["compiled_{eval,train}_bf16"]``: which attention ran in ours;
    * with ``cuda_graphs``, ``compiled_reduce_overhead_eval_bf16_1x3x{H}x{W}``: eval 1x with
      ``mode="reduce-overhead"`` (CUDA graphs, one input size) of each model, and each eager
      (``*_eager``), in the same rounds; ``cudagraph_skips``: compiled graphs that inductor
      ran without CUDA graphs.

    Without ``whole_ours`` the whole of ours is not compiled (over 3 minutes of compiling on an
    H200): ours eager (``ours_eager``) runs in its place, beside mmdet compiled and ours with
    ``compile=True``; ``dynamic``: the ``torch.compile`` of the whole models (False: static
    shapes, one size compiled, as the timed rows need).
    """
    device = args.device
    h, w = size
    bf16 = torch.bfloat16
    _allow_recompiles()
    compiled = {k: B.compile_model(m, dynamic=dynamic) for k, m in models.items() if whole_ours or k != "ours"}
    if not whole_ours:
        compiled["ours_eager"] = models["ours"]
    compiled["ours_regional"] = B.regional_model(models["ours"])  # compile=True: its regions compiled
    x8 = torch.randn(8, 3, h, w, device=device)
    x2 = torch.randn(2, 3, h, w, device=device)
    for kind, x, step in (("eval", x8, eval_step), ("train", x2, train_step)):
        for m in compiled.values():
            m.train(kind == "train")
        fns = {k: step(m, x, bf16) for k, m in compiled.items()}
        results[f"compiled_{kind}_bf16_{x.shape[0]}x3x{h}x{w}"] = compiled_row(
            f"torch.compile {kind} bf16 {x.shape[0]}x3x{h}x{w}", fns, device, args)
    if whole_ours:
        kernels = results.setdefault("sdpa_kernels", {})  # (no eager rows with --compile only)
        ours = compiled["ours"]  # the timed shapes: no recompiles
        kernels["compiled_eval_bf16"] = B.sdpa_kernels(ours.eval(), x8, bf16, False)
        kernels["compiled_train_bf16"] = B.sdpa_kernels(ours.train(), x2, bf16, True)
    if cuda_graphs:
        # Batch-1 eval is launch-bound on a GPU: CUDA graphs replay a whole forward in one launch.
        graphed = {k: B.compile_model(m, mode="reduce-overhead", dynamic=False) for k, m in models.items()}
        for m in models.values():
            m.eval()
        x1 = torch.randn(1, 3, h, w, device=device)
        fns = {k: eval_step(m, x1, bf16) for k, m in graphed.items()}
        fns.update({f"{k}_eager": eval_step(m, x1, bf16) for k, m in models.items()})
        skips = cudagraph_skips()
        # CUDA graph trees record on a call after the compiling one and replay from the next: 3 warm-up rounds.
        times = interleave(fns, device, args.iters, max(args.warmup, 3))
        row = summarize(f"torch.compile reduce-overhead eval bf16 1x3x{h}x{w}", times)
        results[f"compiled_reduce_overhead_eval_bf16_1x3x{h}x{w}"] = {**row,
                                                                       "cudagraph_skips": cudagraph_skips() - skips}
    torch._dynamo.reset()  # frees the compiled graphs and CUDA graph pools before the rows that follow


# ------------------------------------------------------------------- rows both runs share
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


#: ``--padded``'s landscape image (the portrait beside it is W x H): a detection-sized pair.
PADDED_IMAGE = (800, 1333)


def padded_pair(image: Sequence[int], device: str) -> Tuple[torch.Tensor, List[Tuple[int, int]]]:
    """A landscape ``H x W`` and a portrait ``W x H`` image (random, zero beyond each) in one
    ``2 x 3 x S x S`` input, ``S`` the longer side rounded up to 32 (as mmdet's data
    preprocessor pads a batch), and their sizes."""
    h, w = image
    side = -(-max(h, w) // 32) * 32
    sizes = [(h, w), (w, h)]
    x = torch.zeros(2, 3, side, side, device=device)
    for one, (valid_h, valid_w) in zip(x, sizes):
        one[:, :valid_h, :valid_w].normal_()
    return x, sizes


def run_padded(args, results: dict, models: Dict[str, torch.nn.Module],
               autocast_dtype: Optional[torch.dtype] = None) -> None:
    """``--padded``: eval and training on :func:`padded_pair`'s batch (``--padded-size``), in the
    same interleaved rounds: mmdet on the batch, ours with ``valid_sizes`` (image-exact) and
    ours without (``ours_without_valid_sizes``: the padding computed as image). Keys
    ``padded_{eval,train}_{dtype}_2x3x{S}x{S}`` with ``sizes`` and ``padding`` (its share of
    the batch); ``ours_speedup_over`` holds what ``valid_sizes`` gains over computing the padding."""
    x, sizes = padded_pair(args.padded_size, args.device)
    side = x.shape[-1]
    padding = 1 - sum(h * w for h, w in sizes) / (2 * side * side)
    tag = dtype_tag(autocast_dtype)
    ours = models["ours"]
    for kind, step in (("eval", eval_step), ("train", train_step)):
        for m in models.values():
            m.train(kind == "train")
        fns = {"mmdet": step(models["mmdet"], x, autocast_dtype)} if "mmdet" in models else {}
        fns.update(ours=step(ours, x, autocast_dtype, valid_sizes=sizes),
                   ours_without_valid_sizes=step(ours, x, autocast_dtype))
        times = interleave(fns, args.device, args.iters, args.warmup)
        label = (f"padded {'train fwd+bwd' if kind == 'train' else 'eval'} {tag} 2x3x{side}x{side} (images "
                 f"{sizes[0][0]}x{sizes[0][1]} + {sizes[1][0]}x{sizes[1][1]}, {100 * padding:.0f}% padding)")
        results[f"padded_{kind}_{tag}_2x3x{side}x{side}"] = {**summarize(label, times), "sizes": sizes,
                                                             "padding": padding}


def run_v2(args, results: dict, device: str, eval_size: Sequence[int], train_size: Sequence[int],
           evals: Sequence[tuple], trains: Sequence[Optional[torch.dtype]],
           memory_dtype: Optional[str] = None, fp32_tag: str = "fp32") -> None:
    """The Swin V2 rows (``benchmarking.build_v2``): eval at ``eval_size`` for every ``(batch, autocast
    dtype or None)`` of ``evals``, training fwd+bwd of 2 images at ``train_size`` for every
    autocast dtype (or None) of ``trains``, and peak training memory (``memory_dtype``), each
    as ratios of the same interleaved rounds. Keys ``v2_eval_{dtype}_{B}x3x{H}x{W}``,
    ``v2_train_{dtype}_2x3x{H}x{W}`` (``dtype``: ``fp32_tag`` without autocast) and
    ``v2_peak_memory``. The CPU run and the CUDA run differ only in the arguments."""
    models = B.build_v2(device, eval_size, peers=not args.no_peers)
    reference = "timm" if "timm" in models else "ours"
    th, tw = train_size
    rows = [("eval", batch, dtype, eval_size) for batch, dtype in evals]
    rows += [("train", 2, dtype, train_size) for dtype in trains]
    for kind, batch, dtype, (h, w) in rows:
        x = torch.randn(batch, 3, h, w, device=device)
        for m in models.values():
            m.train(kind == "train")
        tag = dtype_tag(dtype, fp32_tag)
        step = train_step if kind == "train" else eval_step
        times = interleave({k: step(m, x, dtype) for k, m in models.items()}, device, args.iters, args.warmup)
        label = f"Swin V2 {'train fwd+bwd' if kind == 'train' else 'eval'} {tag} {batch}x3x{h}x{w}"
        results[f"v2_{kind}_{tag}_{batch}x3x{h}x{w}"] = summarize(label, times, reference)
    if not args.skip_memory:
        mem = {k: B.peak_memory("v2:" + k, device, 2, (th, tw), dtype=memory_dtype) for k in models}
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


# ------------------------------------------------------------------------------- --ablate
#: ``--ablate`` variants: name -> planner switches (see swin_backbone.ops.planner.Switches).
ABLATIONS: Dict[str, Dict[str, object]] = {
    "no SDPA (matmul attention)": dict(sdpa=False),
    "no recompute attention (autograd)": dict(recompute_attention=False),
    "no lean saves (norm / GELU outputs kept)": dict(save_memory=False),
    "no CPU row chunks": dict(chunk_bytes=0),
    "row chunks x0.5": dict(chunk_bytes="half"),
    "row chunks x2": dict(chunk_bytes="double"),
}

#: ``--ablate --v2`` variants (names of :data:`ABLATIONS`): every one reaches SwinV2Backbone
#: through the same ``ops`` functions as V1. sdpa and recompute_attention: ``WindowAttentionV2``
#: runs ``ops.window_attention`` (the plan's kernel) on V1's stage layouts; save_memory:
#: ``ops.cosine_qkv`` and the stage's ``ops.lean_saves`` (norm after the MLP); chunk_bytes: the
#: blocks' row-chunked MLP in inference, the recompute attention's backward and ``ops.output_nchw``.
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


def ablation_variants(names: Sequence[str], only: Optional[Sequence[str]]) -> List[str]:
    """The variants of ``names`` whose name contains a word of ``--only`` (all of them without it)."""
    chosen = list(names) if not only else [name for name in names if any(o in name for o in only)]
    if only and not chosen:
        raise ValueError(f"--only: expected words of the variant names {sorted(names)}, got {only}")
    return chosen


def run_ablations(args, results: dict) -> None:
    """``--ablate``: the ablation of SwinBackbone (Swin-T, key ``ablation``), and with ``--v2``
    that of SwinV2Backbone (``benchmarking.build_v2``'s "ours", key ``v2_ablation``; ``--v2 only``: just
    that), each with the variants ``--only`` chose."""
    device = args.device
    v1 = ablation_variants(ABLATIONS, args.only) if args.v2 != "only" else None
    v2 = ablation_variants(V2_ABLATIONS, args.only) if args.v2 else None  # (checked before anything runs)
    if v1 is not None:
        run_ablation(args, results, B.build_pair(device)["ours"], v1)
    if v2 is not None:
        v2_model = B.build_v2(device, args.eval_size, peers=False)["ours"]
        run_ablation(args, results, v2_model, v2, memory_name="v2:ours", key="v2_ablation",
                     title="Swin V2 ablation of SwinV2Backbone tiny, window 8")


def run_ablation(args, results: dict, model: torch.nn.Module, chosen: Sequence[str], memory_name: str = "ours",
                 key: str = "ablation", title: str = "ablation") -> None:
    """Each optimisation of ``chosen`` (names of :data:`ABLATIONS`) off in turn against the
    defaults, for ``model``: eval, training and memory effects (memory: of ``memory_name``'s
    model in ``benchmarking.memory_child``), printed under ``title`` and stored as ``results[key]``."""
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
    peaks = {} if args.skip_memory else {label[v]: B.peak_memory(memory_name, device, 2, (ts, ts), v)
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
        if peaks:
            row["peak_bytes"] = peaks[name]
            row["memory_effect"] = peaks[name] / peaks[base] - 1
        rows[name] = row
        mem = f"{100 * row['memory_effect']:+8.1f}%" if peaks else "       -"
        if v is None:
            mem = f"{peaks[name] / 2**20:7.0f}MB" if peaks else mem
            print(f"{name:40s} {row['eval_s'] * 1e3:7.0f}ms {row['train_s'] * 1e3:7.0f}ms {mem}")
        else:
            print(f"{name:40s} {100 * row['eval_effect']:+8.1f}% {100 * row['train_effect']:+8.1f}% {mem}")
    results[key] = {"eval_size": [eh, ew], "train_size": ts, "rows": rows,
                    "samples": {"eval": eval_times, "train": train_times}}


def main(argv=None) -> int:
    """Command-line entry point: the exit status. 0: done (the rows as
    lines on stdout, the numbers in ``--json``); 2: a usage error; 1: a failure, in one line."""
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError, RuntimeError, subprocess.CalledProcessError) as err:
        print(f"{PROG}: error: {type(err).__name__}: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
