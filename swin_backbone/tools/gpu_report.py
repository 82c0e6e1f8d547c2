"""The GPU report of ``swin-benchmark --device cuda --report``: what a user pastes into a bug
report, and what any of us runs first on a GPU.

It lists the machine (GPU, compute capability, driver, torch / CUDA / cuDNN / triton
versions), then verifies and times every window-attention candidate (the fused Triton kernel
at each ``num_warps`` worth trying, SDPA) against the float32 reference at the attention
shapes of Swin-T and Swin-B stages on an 800 x 1344 image, per dtype, forward-only and
training: the same verification and timing the backbone runs at first use
(:mod:`swin_backbone.ops.kernel_choice`), with every candidate's error and time shown.
"""
from __future__ import annotations

import platform
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..model.presets import ARCH_SETTINGS
from ..ops import kernel_choice
from ..ops import stage as stage_ops
from ..ops.windows import output_size

#: The architectures and input of the report's attention rows.
REPORT_ARCHES = ("tiny", "base")
REPORT_SIZE = (800, 1344)
REPORT_BATCH = 2
WINDOW = 7


def environment() -> Dict[str, object]:
    """The machine and the versions that decide which kernels work."""
    from .. import __version__
    from ..ops.triton_attention import triton

    info: Dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": getattr(triton, "__version__", None),
        "swin_backbone": __version__,
        "driver": kernel_choice._driver_version(),
    }
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    return info


def attention_shapes(arches: Sequence[str] = REPORT_ARCHES, size: Tuple[int, int] = REPORT_SIZE,
                     patch_size: int = 4) -> List[Dict[str, int]]:
    """Per architecture and stage: the token map, heads and head dim of its attention."""
    rows = []
    for arch in arches:
        preset = ARCH_SETTINGS[arch]
        maps = output_size(size[0], size[1], patch_size, len(preset["depths"]))
        for i, (h, w) in enumerate(maps):
            channels = preset["embed_dims"] * 2**i
            heads = preset["num_heads"][i]
            rows.append(dict(arch=arch, stage=i, height=h, width=w, num_heads=heads, head_dim=channels // heads))
    return rows


def dtypes_for(device: torch.device) -> List[torch.dtype]:
    """fp32, fp16, and bf16 where the device computes it."""
    dtypes = [torch.float32, torch.float16]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        dtypes.append(torch.bfloat16)
    return dtypes


def kernel_rows(
    device: torch.device,
    shapes: Iterable[Dict[str, int]],
    dtypes: Sequence[torch.dtype],
    batch: int = REPORT_BATCH,
    window: int = WINDOW,
    timer=None,
) -> List[Dict[str, object]]:
    """Every candidate verified (largest relative error vs. the float32 reference, output and
    gradients) and timed (ms, median of CUDA-event repetitions) per shape, dtype and mode."""
    rows = []
    for shape in shapes:
        h, w, heads, head_dim = shape["height"], shape["width"], shape["num_heads"], shape["head_dim"]
        for dtype in dtypes:
            for training in (False, True):
                generator = torch.Generator(device=device).manual_seed(0)
                channels = heads * head_dim
                qkv = torch.randn(batch, h * w, 3 * channels, generator=generator, device=device).to(dtype)
                table = torch.randn((2 * window - 1) ** 2, heads, generator=generator, device=device) * 0.5
                inputs = ops.AttentionInputs(qkv, table, window, heads, head_dim ** -0.5)
                plan = ops.plan_for(qkv, grad=training, attention="auto", save_memory=False, chunk_bytes=0)
                # pad_small_map=True (the default): the window stays, maps are padded up to it
                regular, shifted = ops.stage_layouts(h, w, window, window // 2, True, device, plan)
                layout = shifted if shifted is not None else regular
                sig = stage_ops._signature(dtype, device, window, heads, head_dim, training, False)
                reason = stage_ops._shape_reason(window, head_dim, h, w, True) or stage_ops._static_reason(
                    str(dtype).replace("torch.", ""), device.type, device.index, window, heads, head_dim)
                candidates = stage_ops._candidates(lambda: inputs, layout, plan, sig)
                if reason:
                    candidates = [c for c in candidates if c.kernel != "triton"]
                tolerance = kernel_choice.TOLERANCE.get(sig.dtype if sig.precision != "tf32" else "tf32", 3e-2)
                choice = kernel_choice.measure(
                    candidates, lambda: stage_ops._reference(lambda: inputs, layout, plan), tolerance,
                    timer or stage_ops._timer(device))
                if reason:
                    choice.rejected["triton"] = reason
                rows.append(dict(shape, window=window, batch=batch, dtype=sig.dtype, precision=sig.precision,
                                 mode="train" if training else "eval", chosen=choice.kernel, warps=choice.warps,
                                 times_ms=choice.times_ms, errors=choice.errors, rejected=choice.rejected))
    return rows


def format_rows(rows: Sequence[Dict[str, object]]) -> List[str]:
    """One readable line per row."""
    lines = []
    for r in rows:
        cands = sorted(set(r["times_ms"]) | set(r["errors"]) | set(r["rejected"]))
        parts = []
        for c in cands:
            if c in r["rejected"]:
                parts.append(f"{c} REJECTED ({r['rejected'][c]})")
            else:
                t = r["times_ms"].get(c)
                parts.append(f"{c} {'' if t is None else f'{t:.3f} ms, '}err {r['errors'][c]:.1e}")
        chosen = r["chosen"] + (f"/warps{r['warps']}" if r["warps"] else "")
        lines.append(
            f"{r['arch']:>5} stage {r['stage']} {r['batch']}x{r['height']}x{r['width']} w{r['window']} "
            f"{r['num_heads']}x{r['head_dim']} {r['dtype']:<8} {r['mode']:<5} -> {chosen}: " + "; ".join(parts)
        )
    return lines


def report(device: Optional[torch.device] = None) -> Dict[str, object]:
    """The environment and the kernel rows on ``device`` (default: the current CUDA device)."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    env = environment()
    print("GPU report: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    rows = kernel_rows(device, attention_shapes(), dtypes_for(device))
    for line in format_rows(rows):
        print(line)
    return {"environment": env, "attention_kernels": rows}
