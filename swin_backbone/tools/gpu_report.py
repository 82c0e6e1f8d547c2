"""The GPU report of ``swin-benchmark --device cuda --report``: what a user pastes into a bug
report, and what any of us runs first on a GPU.

It lists the machine (GPU, compute capability, driver, torch / CUDA / cuDNN / triton versions,
whether the fused Triton kernel's gate admits it), then, at the attention shapes of Swin-T and
Swin-B stages on an 800 x 1344 image, per dtype, forward-only and training, checks both window
attention kernels against the float64 reference algorithm and times them: the fused Triton
kernel (after :func:`~swin_backbone.ops.triton_attention.verify_once`) and SDPA (the default:
windows partitioned, the per-window bias handed to the memory-efficient kernel, reversed).
The table is Markdown, to paste. Nothing here decides anything for the backbone.
"""
from __future__ import annotations

import platform
import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..model.presets import ARCH_SETTINGS
from ..ops import triton_attention as ta
from ..ops.windows import output_size, padded_size, relative_position_index, window_attention_mask
from ..torch_compat import scaled_dot_product_attention

#: The architectures and input of the report's attention rows.
REPORT_ARCHES = ("tiny", "base")
REPORT_SIZE = (800, 1344)
REPORT_BATCH = 2
WINDOW = 7
#: Timed repetitions per kernel and row (the median is reported), after one warm-up.
REPEAT = 10

Outputs = Tuple[torch.Tensor, ...]


def _driver_version() -> Optional[str]:
    try:
        import ctypes

        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return str(version.value)
    except (OSError, AttributeError):
        return None


def environment() -> Dict[str, object]:
    """The machine and the versions that decide which kernels work."""
    from .. import __version__

    info: Dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": getattr(ta.triton, "__version__", None),
        "swin_backbone": __version__,
        "driver": _driver_version(),
    }
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        gate = ta.static_reason(torch.float16, torch.device("cuda", index), WINDOW, 1, 32)
        info["triton_kernel"] = "allowed" if gate is None else f"declined: {gate}"
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
    """fp32, fp16, and bf16 where the GPU computes it natively (compute capability >= 8.0;
    ``torch.cuda.is_bf16_supported()`` is also true where it is emulated)."""
    dtypes = [torch.float32, torch.float16]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        dtypes.append(torch.bfloat16)
    return dtypes


def sdpa_window_attention(qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int, shift: int,
                          table_window: int, num_heads: int, scale: float) -> torch.Tensor:
    """Window attention through SDPA, as the backbone's default path computes it: ``(B, H * W, 3C)``
    row-major qkv -> ``(B, H * W, C)``.

    Pad, shift and partition qkv; windows into SDPA's head dimension ``(B, nW * nH, N, d)`` so
    that one per-window bias (relative position bias + region mask, 8-aligned rows, the
    query's dtype: the memory-efficient kernel's conditions, which also give the bias its
    gradient) broadcasts over the batch; reverse."""
    batch, _, three_c = qkv.shape
    channels, n = three_c // 3, window * window
    head_dim = channels // num_heads
    hp, wp = padded_size(height, window), padded_size(width, window)
    x = F.pad(qkv.view(batch, height, width, three_c), (0, 0, 0, wp - width, 0, hp - height))
    x = torch.roll(x, (-shift, -shift), (1, 2)) if shift else x
    rows, cols = hp // window, wp // window
    x = x.view(batch, rows, window, cols, window, 3, num_heads, head_dim)
    q, k, v = x.permute(5, 0, 1, 3, 6, 2, 4, 7).reshape(3, batch, rows * cols * num_heads, n, head_dim).unbind(0)
    bias = table[relative_position_index(window, table_window, qkv.device)].view(n, n, num_heads).permute(2, 0, 1)
    pad = -n % 8
    mask = window_attention_mask(height, width, window, shift, True, qkv.device, qkv.dtype)
    mask = torch.zeros(rows * cols, n, n, device=qkv.device, dtype=qkv.dtype) if mask is None else mask
    attn_bias = (F.pad(mask, (0, pad))[:, None] + F.pad(bias.to(qkv.dtype), (0, pad))).narrow(-1, 0, n)
    out = scaled_dot_product_attention(q, k, v, attn_mask=attn_bias.reshape(1, -1, n, n), scale=scale)
    out = out.view(batch, rows, cols, num_heads, window, window, head_dim).permute(0, 1, 4, 2, 5, 3, 6)
    out = out.reshape(batch, hp, wp, channels)
    out = torch.roll(out, (shift, shift), (1, 2)) if shift else out
    return out[:, :height, :width].reshape(batch, height * width, channels)


def _timer(device: torch.device, repeat: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of ``fn`` over ``repeat`` runs after one warm-up, on ``device``."""
    def cuda(fn: Callable[[], object]) -> float:
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device)
            fn()
            times = []
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end))
        return statistics.median(times)

    def cpu(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cuda if device.type == "cuda" else cpu


def _run(kernel: Callable[..., torch.Tensor], qkv: torch.Tensor, table: torch.Tensor, grad_out: torch.Tensor,
         args: tuple, training: bool) -> Outputs:
    """The output and, in training, the gradients of qkv and the table for ``grad_out``."""
    if not training:
        with torch.no_grad():
            return (kernel(qkv, table, *args),)
    qkv, table = qkv.detach().requires_grad_(), table.detach().requires_grad_()
    out = kernel(qkv, table, *args)
    return (out.detach(),) + torch.autograd.grad(out, (qkv, table), grad_out)


def _relative_error(got: Outputs, expected: Outputs) -> float:
    """Largest error over the outputs, each relative to its reference's largest magnitude."""
    errors = [float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, expected)]
    return max(errors)


def kernel_rows(
    device: torch.device,
    shapes: Iterable[Dict[str, int]],
    dtypes: Sequence[torch.dtype],
    batch: int = REPORT_BATCH,
    window: int = WINDOW,
    repeat: int = REPEAT,
) -> List[Dict[str, object]]:
    """Per shape, dtype and mode: each kernel's largest relative error against the float64
    reference (output, and in training the gradients of qkv and the table) and its time (ms,
    median), or why it did not run."""
    rows = []
    timer = _timer(device, repeat)
    for shape in shapes:
        h, w, heads, head_dim = shape["height"], shape["width"], shape["num_heads"], shape["head_dim"]
        channels, shift = heads * head_dim, window // 2 if min(h, w) > window else 0
        args = (h, w, window, shift, window, heads, head_dim ** -0.5)
        for dtype in dtypes:
            name = "tf32" if ta._input_precision(dtype, device) == "tf32" else ta._DTYPES[dtype]
            generator = torch.Generator(device=device).manual_seed(0)
            qkv = torch.randn(batch, h * w, 3 * channels, generator=generator, device=device).to(dtype)
            table = torch.randn((2 * window - 1) ** 2, heads, generator=generator, device=device) * 0.5
            grad_out = torch.randn(batch, h * w, channels, generator=generator, device=device).to(dtype)
            for training in (False, True):
                with torch.enable_grad() if training else torch.no_grad():
                    expected = _run(ta.reference_attention, qkv.double(), table.double(), grad_out.double(), args,
                                    training)
                errors: Dict[str, float] = {}
                times: Dict[str, float] = {}
                rejected: Dict[str, str] = {}
                reason = ta.static_reason(dtype, device, window, heads, head_dim, height=h, width=w)
                if reason is None:
                    try:
                        ta.verify_once(device, dtype)
                    except RuntimeError as error:
                        reason = str(error)
                if reason is not None:
                    rejected["triton"] = reason
                for kernel_name, kernel in (("triton", ta.triton_window_attention), ("sdpa", sdpa_window_attention)):
                    if kernel_name in rejected:
                        continue
                    errors[kernel_name] = _relative_error(_run(kernel, qkv, table, grad_out, args, training), expected)
                    times[kernel_name] = timer(lambda: _run(kernel, qkv, table, grad_out, args, training))
                del expected
                rows.append(dict(shape, window=window, batch=batch, dtype=name, mode="train" if training else "eval",
                                 times_ms=times, errors=errors, rejected=rejected))
    return rows


def format_rows(rows: Sequence[Dict[str, object]]) -> List[str]:
    """A Markdown table: one line per row, both kernels' times and errors, and the speed-up."""
    lines = ["| arch | stage | batch x map | window | heads x dim | dtype | mode | triton ms | sdpa ms | "
             "sdpa / triton | triton err | sdpa err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        times, errors = r["times_ms"], r["errors"]
        triton_ms = f"{times['triton']:.3f}" if "triton" in times else f"declined: {r['rejected'].get('triton')}"
        ratio = f"{times['sdpa'] / times['triton']:.2f}x" if {"triton", "sdpa"} <= set(times) else "-"
        lines.append(
            f"| {r['arch']} | {r['stage']} | {r['batch']}x{r['height']}x{r['width']} | w{r['window']} | "
            f"{r['num_heads']}x{r['head_dim']} | {r['dtype']} | {r['mode']} | {triton_ms} | "
            f"{times['sdpa']:.3f} | {ratio} | "
            + " | ".join(f"{errors[k]:.1e}" if k in errors else "-" for k in ("triton", "sdpa")) + " |"
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
