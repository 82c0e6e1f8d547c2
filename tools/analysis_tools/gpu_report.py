"""The prepared GPU run: the benchmark's main rows on one GPU within minutes, as JSON and as the
table of docs/performance.md, with the card they ran on.

    python tools/analysis_tools/gpu_report.py --json gpu.json --markdown gpu.md
    python tools/analysis_tools/gpu_report.py --device cpu --size 64 96 --padded-size 40 64 --iters 1   # a smoke run

In this order (ours, mmdet, timm and torchvision where installed; Swin-T, the same weights for
ours and mmdet; 3x800x1344 unless ``--size``), each row as ``benchmark.py --device cuda`` runs it:

1. eval bf16 at 1 and 8 images, training fwd+bwd bf16 at 2 images;
2. peak training memory bf16 at 2 images (a fresh process per model);
3. the padded detection batch (``--padded-size``: an 800x1333 landscape beside a 1333x800
   portrait, 41% padding), eval and training bf16: mmdet, ours with ``valid_sizes``, ours
   without;
4. lean saves on this device: training bf16 at 2 images, ours with ``save_memory=True`` beside
   ours as built (and mmdet), time and (CUDA) peak memory growth of one step, in one process;
5. stochastic depth as the detection configs set it (``drop_path_rate=0.2``, Swin-T's): training
   bf16 at 2 images, mmdet and ours both at that rate (the branches still run; the draws add a
   few small kernels per block, on the host a GPU step waits on), beside ours at rate 0;
6. host time: of eval bf16 at 1 image and training bf16 at 2, the time until the step's Python
   returns (its kernels launched) against the step, ours and mmdet (equal: the GPU waits on the
   host; on the CPU they are equal by nature);
7. ``torch.compile`` eval bf16 8x and training bf16 2x: mmdet compiled (static shapes), ours with
   ``compile=True`` (its regions compiled, dynamic) and ours eager, each compiled one with its
   first, compiling call's time (minutes of compiling: last, and skipped with a note once
   ``--budget`` is spent). The whole of ours is not compiled here: on an H200 that took over 3
   minutes (``benchmark.py --device cuda --compile only`` times it);
8. CUDA graphs (``mode="reduce-overhead"``, static shapes), for the steps that wait on the host:
   training bf16 2x, then eval bf16 1x: mmdet compiled so, ours with ``compile=dict(mode=
   "reduce-overhead", dynamic=False, regions=False)`` (compiled whole, as mmdet is), ours with
   ``compile=dict(mode="reduce-overhead", dynamic=False)`` (its regions, each a CUDA graph; each
   forward marks a CUDA-graph step, so compiled mmdet's calls are marked too) and ours eager,
   with first calls and how many graphs inductor ran without CUDA graphs. A full run's budget
   leaves it out: run it alone in a call of its own (``--steps cudagraphs``, about 6 minutes on
   an H200, most of it compiling mmdet and ours whole). An error in it is recorded in the JSON
   (``cudagraphs_error``), not raised.

``--steps`` runs some of them (names: :data:`STEPS`). The JSON and the Markdown are rewritten
after every row, so a run cut short keeps the rows it finished. On the CPU (``--device cpu``)
every row runs the same code at whatever size is given (CUDA graphs are CUDA's: there inductor
runs the graphs without them).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmark.py and benchmarking.py beside it

import benchmark  # noqa: E402  (puts the checkout's package on the path)
import benchmarking as B  # noqa: E402

from swin_backbone.checkpoint.files import atomic_write  # noqa: E402
from swin_backbone.tools.common import one_line  # noqa: E402

#: The timed rows of (1), as ``benchmark.CUDA_ROWS``.
ROWS = [("eval", 1, torch.bfloat16, None), ("eval", 8, torch.bfloat16, None), ("train", 2, torch.bfloat16, None)]
#: The stochastic-depth row's rate: mmdet's Swin-T detection configs'.
DROP_PATH_RATE = 0.2
#: Ours changed one way, as a row's extra lines: its key in a row's timings -> its name in the table.
VARIANTS = {
    "ours_eager": "ours eager",  # the compiled rows: the whole of ours not compiled, beside compiled mmdet
    "ours_whole": "ours compiled whole (compile=dict(..., regions=False))",  # the CUDA-graph rows
    "ours_save_memory": "ours save_memory=True",  # the lean-saves row (with CUDA's peak memory)
    "ours_rate_0": "ours at rate 0",  # the stochastic-depth row: ours without it
}
#: The steps of the module docstring, in order: ``--steps`` name -> its name in the notes.
STEPS = {"rows": "eval / training rows", "memory": "peak memory", "padded": "padded batch", "lean": "lean saves",
         "drop_path": "stochastic depth", "host": "host time", "compile": "torch.compile rows",
         "cudagraphs": "CUDA graphs rows"}
#: The CUDA-graph step's compile options (ours: its ``compile`` argument; mmdet: ``torch.compile``'s).
CUDA_GRAPHS = dict(mode="reduce-overhead", dynamic=False)
#: The columns of the table, in docs/performance.md's order: model -> its name there.
COLUMNS = {"mmdet": "mmdet", "timm": "timm", "torchvision": "torchvision", "ours": "SwinBackbone"}


def label(key: str, row: dict) -> str:
    """A row's name in the table, from its key (``compiled_train_bf16_2x3x800x1344`` ->
    ``torch.compile train fwd+bwd bf16 2x3x800x1344``)."""
    words = key.replace("compiled", "torch.compile").replace("train", "train fwd+bwd").split("_")
    if "padding" in row:
        (h, w), (h2, w2) = row["sizes"]
        words.append(f"(images {h}x{w} + {h2}x{w2}, {100 * row['padding']:.0f}% padding)")
    return " ".join(words)


def markdown(results: dict) -> List[str]:
    """docs/performance.md's table of ``results``: one line per row, each model's median time (or
    peak memory), and ours against mmdet (a speedup, or the memory ratio)."""
    env = results.get("environment", {})
    head = [f"{name} {env.get(k) or ''}".rstrip() for k, name in COLUMNS.items()]
    lines = [f"{env.get('gpu') or env.get('cpu', '?')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
             f"driver {env.get('driver')}; {results.get('date')}, {results.get('iters')} interleaved rounds, medians",
             "", "| measure | " + " | ".join(head) + " | ours vs mmdet |", "|---" * (len(COLUMNS) + 2) + "|"]
    for key, row in results.items():
        if isinstance(row, dict) and "median_s" in row:
            med = row["median_s"]
            cells = [f"{med[k] * 1e3:.1f} ms" if k in med else "" for k in COLUMNS]
            ratio = row.get("speedup_over_mmdet", {}).get("ours")
            lines.append(f"| {label(key, row)} | " + " | ".join(cells)
                         + (f" | **{ratio:.2f}x** |" if ratio else " | |"))
            if "ours_without_valid_sizes" in med:
                gain = row["ours_speedup_over"]["ours_without_valid_sizes"] if "ours_speedup_over" in row else (
                    row["speedup_over_ours"]["ours_without_valid_sizes"] ** -1)
                lines.append(f"| {label(key, row)}, ours without valid_sizes | | | | "
                             f"{med['ours_without_valid_sizes'] * 1e3:.1f} ms | valid_sizes **{gain:.2f}x** faster |")
            if "ours_regional" in med:  # the compiled rows: ours in its compiled mode (its regions compiled)
                first = row.get("first_call_s", {})
                skips = f"; {row['cudagraph_skips']} graphs without CUDA graphs" if row.get("cudagraph_skips") else ""
                lines.append(f"| {label(key, row)}, ours {row.get('ours_compile', 'compile=True')} (regions compiled)"
                             f" | | | | {med['ours_regional'] * 1e3:.1f} ms | "
                             f"**{row['speedup_over_mmdet']['ours_regional']:.2f}x** (first call: "
                             + ", ".join(f"{k} {v:.0f} s" for k, v in first.items()) + f"{skips}) |")
            for variant, name in VARIANTS.items():  # ours changed one way, beside the row's models
                if variant not in med:
                    continue
                peak = row.get("peak_bytes", {}) if variant == "ours_save_memory" else {}
                mem = (f", peak {peak[variant] / 2**20:.0f} MiB against {peak['ours'] / 2**20:.0f} MiB"
                       + (f" (mmdet {peak['mmdet'] / 2**20:.0f} MiB)" if "mmdet" in peak else "")) if peak else ""
                lines.append(f"| {label(key, row)}, {name} | | | | {med[variant] * 1e3:.1f} ms | "
                             f"**{row['speedup_over_mmdet'][variant]:.2f}x**{mem} |")
        elif key == "host_time":
            for kind, batch in (("eval", 1), ("train", 2)):
                cells = [f"{t['host_s'] * 1e3:.1f} of {t['step_s'] * 1e3:.1f} ms" if t else ""
                         for t in (row.get(f"{k}_{kind}_{batch}x") for k in COLUMNS)]
                what = "eval bf16 1x" if kind == "eval" else "train fwd+bwd bf16 2x"
                lines.append(f"| host time of a step, {what}{row['size']} (until its Python returns, of the step) | "
                             + " | ".join(cells) + " | |")
        elif key == "peak_memory":
            cells = [f"{row[f'{k}_bytes'] / 2**20:.0f} MiB" if f"{k}_bytes" in row else "" for k in COLUMNS]
            ratio = row.get("ratio_over_mmdet")
            lines.append(f"| peak training memory bf16 {row['size']} | " + " | ".join(cells)
                         + (f" | **{ratio:.2f}x** |" if ratio else " | |"))
    lines += [""] + [f"Not run: {note}" for note in results.get("skipped", [])]
    return lines


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/analysis_tools/gpu_report.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--json", default="gpu_report.json", help="the rows (default: %(default)s)")
    parser.add_argument("--markdown", default="gpu_report.md", help="the table (default: %(default)s)")
    parser.add_argument("--size", type=int, nargs=2, default=benchmark.CUDA_SIZE, metavar=("H", "W"))
    parser.add_argument("--padded-size", type=int, nargs=2, default=benchmark.PADDED_IMAGE, metavar=("H", "W"))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", type=float, default=7.0, metavar="MIN",
                        help="minutes after which the rows not yet started are skipped (default: %(default)s)")
    parser.add_argument("--steps", default=",".join(STEPS), metavar="NAMES",
                        help="comma-separated steps to run; they run in the order listed here (default: all: %(default)s)")
    args = parser.parse_args(argv)
    args.steps = [name.strip() for name in args.steps.split(",") if name.strip()]
    unknown = [name for name in args.steps if name not in STEPS]
    if unknown or not args.steps:
        parser.error(f"--steps: expected comma-separated names of {', '.join(STEPS)}, got {unknown or args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: 'cuda' asked for, but CUDA is not available on this machine; expected --device cpu")
    for option, value, low in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                               ("--size", min(args.size), 1), ("--padded-size", min(args.padded_size), 1)):
        if value < low:
            parser.error(f"{option}: expected ints >= {low}, got {value}")
    for option in ("--json", "--markdown"):
        path = getattr(args, option[2:])
        if os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{option}: expected a file path in an existing folder, got {path!r}")
    # What the benchmark's row functions read from its own command line.
    args.no_peers, args.skip_memory, args.compile, args.upernet, args.padded = False, False, "also", None, "also"
    return args


def run(args: argparse.Namespace) -> dict:
    """The rows of the module docstring; the results (also in ``--json`` and ``--markdown``)."""
    start = time.perf_counter()
    results = B.SavedResults(args.json)
    results.update(environment=B.environment(), date=time.strftime("%Y-%m-%d"), iters=args.iters,
                   warmup=args.warmup, skipped=[])
    print("environment: " + ", ".join(f"{k} {v}" for k, v in results["environment"].items()), flush=True)
    models = B.build_pair(args.device)
    peers = B.build_peers(args.device, args.size)
    h, w = args.size
    bf16 = torch.bfloat16

    def memory() -> None:
        mem = {k: B.peak_memory(k, args.device, 2, (h, w), dtype="bfloat16") for k in {**models, **peers}}
        row: Dict[str, object] = {"size": f"2x3x{h}x{w}", **{f"{k}_bytes": v for k, v in mem.items()}}
        row.update({f"ratio_over_{k}": mem["ours"] / v for k, v in mem.items() if k != "ours"})
        results["peak_memory"] = row

    def lean_saves() -> None:
        for m in models.values():
            m.train()
        x = torch.randn(2, 3, h, w, device=args.device)
        step = B.train_step(models["ours"], x, bf16)
        fns = {k: B.train_step(m, x, bf16) for k, m in models.items() if k != "ours"}
        fns.update(ours=step, ours_save_memory=B.with_switches(step, dict(save_memory=True)))
        times = B.interleave(fns, args.device, args.iters, args.warmup)
        row = B.summarize(f"lean_saves train fwd+bwd bf16 2x3x{h}x{w}", times)
        if args.device == "cuda":
            row["peak_bytes"] = {k: B.step_peak_cuda(fn) for k, fn in fns.items()}
        results[f"lean_saves_train_bf16_2x3x{h}x{w}"] = row

    def stochastic_depth() -> None:
        x = torch.randn(2, 3, h, w, device=args.device)
        fns = {}
        for k, m in {**B.build_pair(args.device, drop_path_rate=DROP_PATH_RATE), "ours_rate_0": models["ours"]}.items():
            m.train()
            fns[k] = B.train_step(m, x, bf16)
        times = B.interleave(fns, args.device, args.iters, args.warmup)
        results[f"drop_path_{DROP_PATH_RATE}_train_bf16_2x3x{h}x{w}"] = B.summarize(
            f"drop_path {DROP_PATH_RATE} train fwd+bwd bf16 2x3x{h}x{w}", times)

    def host_time() -> None:
        row: Dict[str, object] = {}
        for kind, batch, step in (("eval", 1, B.eval_step), ("train", 2, B.train_step)):
            x = torch.randn(batch, 3, h, w, device=args.device)
            for name, m in models.items():
                m.train(kind == "train")
                fn = step(m, x, bf16)
                for _ in range(args.warmup):
                    fn()
                row[f"{name}_{kind}_{batch}x"] = dict(zip(("host_s", "step_s"),
                                                          B.host_and_step(fn, args.device, 2 * args.iters + 1)))
        results["host_time"] = {"size": f"3x{h}x{w}", **row}

    def cuda_graphs() -> None:
        # Each compiled graph replayed as one CUDA graph: the launches a step waits on leave the host.
        graphed = {k: B.compile_model(m, **CUDA_GRAPHS) for k, m in models.items() if k != "ours"}
        graphed.update(ours_whole=B.regional_model(models["ours"], **CUDA_GRAPHS, regions=False),
                       ours_regional=B.regional_model(models["ours"], **CUDA_GRAPHS), ours_eager=models["ours"])
        # (CUDA graph trees record on the call after the compiling one and replay from the next)
        timing = argparse.Namespace(**{**vars(args), "warmup": max(args.warmup, 2)})
        ours_compile = "compile=dict(" + ", ".join(f"{k}={v!r}" for k, v in CUDA_GRAPHS.items()) + ")"
        try:
            for kind, batch, step in (("train", 2, B.train_step), ("eval", 1, B.eval_step)):
                x = torch.randn(batch, 3, h, w, device=args.device)
                for m in graphed.values():
                    m.train(kind == "train")
                skips = benchmark.cudagraph_skips()
                key = f"compiled_reduce_overhead_{kind}_bf16_{batch}x3x{h}x{w}"
                # the models compiled whole (mmdet, ours whole) mark their steps here; our regions mark their own
                fns = {k: step(m, x, bf16) if k == "ours_eager" or getattr(m, "marks_cuda_graph_steps", False)
                       else B.marked_step(step(m, x, bf16)) for k, m in graphed.items()}
                row = benchmark.compiled_row(key.replace("_", " "), fns, args.device, timing)
                results[key] = {**row, "cudagraph_skips": benchmark.cudagraph_skips() - skips,
                                "ours_compile": ours_compile}
        except Exception as err:  # (a path not yet run on a GPU: its error is a result, not the end of the run)
            results["cudagraphs_error"] = f"{type(err).__name__}: {one_line(err)}"
            print(f"CUDA graphs rows: {results['cudagraphs_error']}", flush=True)
        finally:
            torch._dynamo.reset()  # (frees the graphs and their CUDA graph pools)

    steps: Dict[str, Callable[[], None]] = {
        "rows": lambda: benchmark.run_rows(args, results, {**models, **peers}, ROWS, (h, w)),
        "memory": memory,
        "padded": lambda: benchmark.run_padded(args, results, models, bf16),
        "lean": lean_saves,
        "drop_path": stochastic_depth,
        "host": host_time,
        "compile": lambda: benchmark.run_compiled(args, results, models, (h, w), cuda_graphs=False, whole_ours=False,
                                                  dynamic=False),
        "cudagraphs": cuda_graphs,
    }
    for name in (name for name in STEPS if name in args.steps):
        if time.perf_counter() - start > args.budget * 60:
            results["skipped"] = results["skipped"] + [f"{STEPS[name]} (the {args.budget} min budget was spent)"]
            continue
        steps[name]()
        write_markdown(args, results)
    results["seconds"] = round(time.perf_counter() - start, 1)
    write_markdown(args, results)
    print(f"wrote {args.json} and {args.markdown} in {results['seconds']:.0f} s")
    return dict(results)


def write_markdown(args: argparse.Namespace, results: dict) -> None:
    atomic_write(args.markdown, ("\n".join(markdown(results)) + "\n").encode())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """0: done; 2: a usage error; 1: a failure, in one line (the rows finished are kept)."""
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"gpu_report: error: {type(err).__name__}: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
