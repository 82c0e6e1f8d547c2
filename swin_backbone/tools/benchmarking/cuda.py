"""The CUDA run of ``swin-benchmark --device cuda`` (its rows also run on the CPU, at tiny sizes,
in the tests: the TF32 switches are flags only there)."""
from __future__ import annotations

import contextlib
import json
from typing import Optional, Sequence

import torch

from . import builders, memory
from .compiled import run_compiled
from .measure import interleave, sdpa_kernels
from .report import memory_row, summarize
from .rows import padded_batch, run_v2, upernet_step, valid_sizes_overhead
from .steps import dtype_tag, eval_step, tf32, train_step

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
    models = builders.build_pair(device)
    if args.compile == "only":  # a device call of its own (compiling takes minutes)
        run_compiled(args, results, models, size)
        return
    peers = {} if args.no_peers else builders.build_peers(device, (h, w))
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
        mem = {k: memory.peak_memory(k, device, 2, (h, w), dtype="bfloat16") for k in models}
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
