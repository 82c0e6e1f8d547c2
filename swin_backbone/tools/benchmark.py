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
import os
import subprocess
import sys
import time
from typing import List

import torch

from .benchmarking import ablation, memory
from .benchmarking.builders import PEERS, installed
from .benchmarking.cpu import run_cpu, run_cpu_v2
from .benchmarking.cuda import run_cuda, run_cuda_v2
from .benchmarking.report import SavedResults
from .common import one_line


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
            names = ((ablation.ABLATIONS if args.v2 != "only" else {}).keys()
                     | (set(ablation.V2_ABLATIONS) if args.v2 else set()))
            ablation.ablation_variants(sorted(names), args.only)
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
        memory.memory_child(args.memory_child, args.device, args.batch, args.memory_size,
                            ablation.switches(args.ablate_variant), args.memory_dtype)
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
        ablation.run_ablations(args, results)
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
        print(f"swin-benchmark: error: {type(err).__name__}: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
