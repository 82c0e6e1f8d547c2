"""Fused shifted-window attention in Triton (opt-in, ``attention='triton'``): one launch each way.

``(B, H * W, 3C)`` row-major qkv -> ``(B, H * W, C)`` row-major output; pad, shift, partition,
region mask, bias, softmax and reverse in one pass. This module owns the kernel's limits
(:func:`shape_reason`), its gate (:func:`environment_reason`), the stage check the planner asks
(:func:`stage_kernel`) and its one check against the reference (:func:`verify_once`).
Importing compiles nothing and needs no GPU or triton; the interpreter needs
``TRITON_INTERPRET=1`` before ``triton.language`` is imported. docs/gpu-kernel.md.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from mmengine.logging import print_log
from torch import nn

from ..torch_compat import matmul_allows_tf32, parse_version
from .attention import reference_window_attention
from .windows import relative_position_index

if TYPE_CHECKING:
    from .layouts import WindowLayout
    from .planner import Plan

try:  # triton is optional: the module must import (and answer ``static_reason``) without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

__all__ = ["triton_window_attention", "stage_kernel", "static_reason", "environment_reason", "shape_reason",
           "unsupported_reason", "verify_once", "MAX_TOKENS", "MAX_HEAD_DIM", "COMPILE_TARGETS", "TRITON_VERSIONS"]

#: Programs a launch aims for (``nH * G``); also bounds the table-gradient buffer ``(G, nH, N, N)``.
TARGET_PROGRAMS = 1024

#: The one launch shape: a window (``N <= 64``) in 64 rows, a head (``head_dim <= 32``) in 32
#: columns. Larger blocks spill registers (docs/gpu-kernel.md); one shape keeps the variants few.
BLOCK_N = 64
BLOCK_D = 32
NUM_WARPS = 8
NUM_STAGES = 2

MAX_TOKENS = BLOCK_N  #: largest ``N = ws * ws`` (``ws <= 8``)
MAX_HEAD_DIM = BLOCK_D  #: Swin's is 32 in every published configuration

#: Compute capabilities (``major * 10 + minor``) whose compile matrix is clean: the kernel runs on
#: exactly these. sm_70 / sm_75 fail or abort in Triton 3.0-3.3 (docs/gpu-kernel.md).
COMPILE_TARGETS: Tuple[int, ...] = (80, 86, 89, 90)

#: Triton versions whose compile matrix (every variant, every target) is clean; 3.3, 3.4 and 3.9
#: spill 1.1-1.5 KB per thread in the sm_90 TF32 backward (docs/gpu-kernel.md).
TRITON_VERSIONS: Tuple[Tuple[int, int], ...] = ((3, 0), (3, 1), (3, 2), (3, 5), (3, 6), (3, 7), (3, 8))

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def launch_variants() -> List[Tuple[str, str, bool]]:
    """Every ``(element type, input precision, backward)`` the launcher compiles (per target)."""
    types = [("fp32", "ieee"), ("fp32", "tf32"), ("fp16", "ieee"), ("bf16", "ieee")]
    return [(ty, precision, backward) for ty, precision in types for backward in (False, True)]


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _interpreting() -> bool:
    """Whether Triton kernels would run in the interpreter (read now, not at import)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _library_interpreted() -> bool:
    """Whether ``triton.language`` was imported with the interpreter on (its own jit functions
    are decorated at import: an interpreted kernel cannot call compiled-mode ones)."""
    if triton is None:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # triton < 3.0 (declined by static_reason anyway)
        return False

    return isinstance(tl.sum, InterpretedFunction)


# The kernel: one body for forward and backward (``BACKWARD`` constexpr). qkv (B, H * W, 3C) and
# table ((2tw-1)**2, nH) contiguous; io: forward output / its gradient (B, H * W, C); backward
# writes grad_qkv (B, H * W, 3C) and dbias (G, nH, N, N) fp32. qk_scale = scale * log2(e).
def _window_attention_kernel(
    qkv_ptr, table_ptr, io_ptr, grad_qkv_ptr, dbias_ptr,
    height, width, padded_h, padded_w, window, shift, table_window, windows_per_image, windows_per_row,
    total_windows, windows_per_program, num_heads, head_dim, seq_len, qk_scale, scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, BACKWARD: tl.constexpr,
):
    head = tl.program_id(0)
    group = tl.program_id(1)
    channels = num_heads * head_dim
    tokens = height * width

    # In-window coordinates of the block's rows; rows >= N are block padding.
    pos = tl.arange(0, BLOCK_N)
    in_window = pos < seq_len
    pos_r = pos // window
    pos_c = pos % window
    pair_ok = in_window[:, None] & in_window[None, :]

    # This head's relative position bias, once per program, in log2 units like the logits.
    rel_r = pos_r[:, None] - pos_r[None, :] + table_window - 1
    rel_c = pos_c[:, None] - pos_c[None, :] + table_window - 1
    rel = rel_r * (2 * table_window - 1) + rel_c
    bias = tl.load(table_ptr + rel * num_heads + head, mask=pair_ok, other=0.0).to(tl.float32)
    bias = bias * 1.4426950408889634

    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < head_dim
    q_cols = head * head_dim + cols  # channel order of qkv: [q | k | v], each head-major
    k_cols = q_cols + channels
    v_cols = q_cols + 2 * channels

    if BACKWARD:
        dbias = tl.full((BLOCK_N, BLOCK_N), 0.0, dtype=tl.float32)

    for step in range(windows_per_program):
        index = group * windows_per_program + step  # window over the whole batch
        image = index // windows_per_image
        win = index % windows_per_image
        # Coordinates in the padded, shifted map, and the token each one shows.
        r = (win // windows_per_row) * window + pos_r
        c = (win % windows_per_row) * window + pos_c
        src_r = (r + shift) % padded_h
        src_c = (c + shift) % padded_w
        real = in_window & (src_r < height) & (src_c < width) & (index < total_windows)
        # Shift regions as in windows._shift_regions (shift == 0: one region per window).
        region = ((r >= padded_h - window).to(tl.int32) + (r >= padded_h - shift).to(tl.int32)) * 3 + (
            (c >= padded_w - window).to(tl.int32) + (c >= padded_w - shift).to(tl.int32)
        )
        # Real keys of the query's own region only (padding keys are never attended to).
        allowed = (region[:, None] == region[None, :]) & real[None, :]

        row = (image * tokens + src_r * width + src_c).to(tl.int64)
        tile_ok = real[:, None] & col_ok[None, :]
        qkv_rows = qkv_ptr + row[:, None] * (3 * channels)
        q = tl.load(qkv_rows + q_cols[None, :], mask=tile_ok, other=0.0)
        k = tl.load(qkv_rows + k_cols[None, :], mask=tile_ok, other=0.0)
        v = tl.load(qkv_rows + v_cols[None, :], mask=tile_ok, other=0.0)

        logits = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale + bias
        logits = tl.where(allowed, logits, float("-inf"))
        row_max = tl.max(logits, axis=1)
        # Rows with no key at all are never stored: keep them finite, not NaN.
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        p = tl.exp2(logits - row_max[:, None])
        row_sum = tl.sum(p, axis=1)
        row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)

        io_rows = io_ptr + row[:, None] * channels + q_cols[None, :]
        if BACKWARD:
            p = p / row_sum[:, None]
            grad_out = tl.load(io_rows, mask=tile_ok, other=0.0)
            # FMA dots (fp32 ieee) compute dV, dK as (N, D) tiles; tensor-core dots as (D, N) from
            # loaded tiles only: Triton miscompiles a transposed dot result fed to tl.dot on Hopper
            # in some versions (wrong dK), and the (D, N) form spills in fp32 (docs/gpu-kernel.md).
            fma: tl.constexpr = INPUT_PRECISION == "ieee" and q.dtype == tl.float32
            grad_p = tl.dot(grad_out, tl.trans(v), input_precision=INPUT_PRECISION)
            # Softmax backward: dS = P * (dP - rowsum(P * dP)); padding queries have dO = 0.
            delta = tl.sum(p * grad_p, axis=1)
            grad_s = p * (grad_p - delta[:, None])
            dbias += grad_s
            grad_s_in = grad_s.to(q.dtype)
            grad_q = tl.dot(grad_s_in, k, input_precision=INPUT_PRECISION) * scale
            grad_rows = grad_qkv_ptr + row[:, None] * (3 * channels)
            out_ty = grad_qkv_ptr.dtype.element_ty
            tl.store(grad_rows + q_cols[None, :], grad_q.to(out_ty), mask=tile_ok)
            if fma:
                grad_v = tl.dot(tl.trans(p), grad_out, input_precision=INPUT_PRECISION)
                grad_k = tl.dot(tl.trans(grad_s_in), q, input_precision=INPUT_PRECISION) * scale
                tl.store(grad_rows + k_cols[None, :], grad_k.to(out_ty), mask=tile_ok)
                tl.store(grad_rows + v_cols[None, :], grad_v.to(out_ty), mask=tile_ok)
            else:
                grad_v_t = tl.dot(tl.trans(grad_out), p.to(grad_out.dtype), input_precision=INPUT_PRECISION)
                grad_k_t = tl.dot(tl.trans(q), grad_s_in, input_precision=INPUT_PRECISION) * scale
                grad_rows_t = grad_qkv_ptr + row[None, :] * (3 * channels)  # (D, N) tiles
                tile_ok_t = col_ok[:, None] & real[None, :]
                tl.store(grad_rows_t + k_cols[:, None], grad_k_t.to(out_ty), mask=tile_ok_t)
                tl.store(grad_rows_t + v_cols[:, None], grad_v_t.to(out_ty), mask=tile_ok_t)
        else:
            out = tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION) / row_sum[:, None]
            tl.store(io_rows, out.to(io_ptr.dtype.element_ty), mask=tile_ok)

    if BACKWARD:
        slot = dbias_ptr + (group * num_heads + head).to(tl.int64) * seq_len * seq_len
        tl.store(slot + pos[:, None] * seq_len + pos[None, :], dbias, mask=pair_ok)


_JITTED: Dict[bool, object] = {}


def _kernel():
    """The kernel, jit-decorated for the current mode (compiled or interpreted) on first use."""
    interpret = _interpreting()
    if interpret not in _JITTED:
        # No integer specialization: one variant per dtype serves every size (the ones the compile
        # test builds). Pointers keep the 16-byte alignment hint (the launcher aligns them).
        _JITTED[interpret] = triton.jit(_window_attention_kernel, do_not_specialize=INTEGER_ARGUMENTS)
    return _JITTED[interpret]


#: The kernel's integer arguments (all passed as i32, never specialized).
INTEGER_ARGUMENTS = ("height", "width", "padded_h", "padded_w", "window", "shift", "table_window",
                     "windows_per_image", "windows_per_row", "total_windows", "windows_per_program", "num_heads",
                     "head_dim", "seq_len")


# ---------------------------------------------------------------------- where it may run
def unsupported_reason(qkv: torch.Tensor, window: int, num_heads: int, *, height: Optional[int] = None,
                       width: Optional[int] = None, mask_padding: bool = True, dropout_p: float = 0.0) -> Optional[str]:
    """:func:`static_reason` for a ``(B, H * W, 3C)`` ``qkv`` (its device, dtype and shape)."""
    if qkv.dim() != 3 or num_heads <= 0 or qkv.shape[-1] % (3 * num_heads):
        return f"qkv of shape {tuple(qkv.shape)} is not (B, L, 3 * num_heads * head_dim) for num_heads={num_heads}"
    return static_reason(qkv.dtype, qkv.device, window, num_heads, qkv.shape[-1] // (3 * num_heads), height=height,
                         width=width, mask_padding=mask_padding, dropout_p=dropout_p)


def static_reason(dtype: torch.dtype, device: torch.device, window: int, num_heads: int, head_dim: int, *,
                  height: Optional[int] = None, width: Optional[int] = None, mask_padding: bool = True,
                  dropout_p: float = 0.0) -> Optional[str]:
    """Why :func:`triton_window_attention` cannot run on this attention, or ``None`` if it can
    (``mask_padding=False`` needs ``height`` and ``width`` that rule padding out): the
    environment (:func:`environment_reason`), then the shape (:func:`shape_reason`)."""
    reason = environment_reason(dtype, device)
    if reason is None:
        reason = shape_reason(window, head_dim, height=height, width=width, mask_padding=mask_padding,
                              dropout_p=dropout_p)
    return reason


def environment_reason(dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why the kernel cannot run on ``device`` in ``dtype`` (triton, its version, the GPU, the
    interpreter), or ``None``."""
    if triton is None:
        return "triton is not installed"
    reason = triton_version_reason(str(triton.__version__))
    if reason is not None:
        return reason
    interpret = _interpreting()
    if device.type == "cuda":
        reason = _gpu_reason(device)
        if reason is not None:
            return reason
    elif not (interpret and device.type == "cpu"):
        return f"device {device.type!r} needs an NVIDIA GPU (or TRITON_INTERPRET=1 for CPU tensors)"
    if interpret and not _library_interpreted():
        return "TRITON_INTERPRET=1 was set after triton.language was imported (set it before)"
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    if dtype == torch.bfloat16 and interpret:
        return "bfloat16 tl.dot gives wrong results in the Triton interpreter"
    return None


def shape_reason(window: int, head_dim: int, *, height: Optional[int] = None, width: Optional[int] = None,
                 mask_padding: bool = True, dropout_p: float = 0.0) -> Optional[str]:
    """Why the kernel does not cover this window, head size and padding (its limits), or ``None``."""
    if head_dim <= 0 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: the kernel holds 1..{MAX_HEAD_DIM} channels per head"
    if window <= 0 or window * window > MAX_TOKENS:
        return f"window {window}: a window must hold 1..{MAX_TOKENS} tokens (window <= {int(MAX_TOKENS ** 0.5)})"
    if dropout_p > 0:
        return "no attention dropout in the kernel"
    if not mask_padding:
        if height is None or width is None:
            return "mask_padding=False needs height and width to rule out padding"
        if height % window or width % window:
            return "mask_padding=False on a padded map (real tokens attend to padding tokens, never loaded here)"
    return None


def stage_kernel(plan: "Plan", layout: "WindowLayout", *, num_heads: int, head_dim: int, mask_padding: bool) -> str:
    """The kernel that runs a stage for ``attention='triton'`` (its :attr:`Kernel.check
    <swin_backbone.ops.attention.Kernel.check>`): ``'triton'`` where it covers the stage (checked
    once per process against the reference: :func:`verify_once`); SDPA where the stage's shape is
    beyond its limits (said once); ``RuntimeError`` where it cannot run here at all."""
    reason = shape_reason(layout.window, head_dim, height=layout.height, width=layout.width,
                          mask_padding=mask_padding)
    if reason is not None:
        _say_once(f"attention='triton': the fused kernel does not cover this stage ({reason}): SDPA runs it")
        return "plain" if plan.tracing and plan.grad else "sdpa"
    device = layout.index.device
    reason = environment_reason(plan.mask_dtype, device)
    if reason is not None:
        raise RuntimeError("attention='triton' (or SWIN_BACKBONE_ATTENTION=triton): the fused Triton kernel cannot "
                           f"run here: {reason}")
    if not plan.tracing:
        verify_once(device, plan.mask_dtype)
    return "triton"


_SAID: set = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        print_log(message, logger="current", level=logging.WARNING)


_GPU_REASONS: Dict[int, Optional[str]] = {}


def _gpu_reason(device: torch.device) -> Optional[str]:
    """The capability part of the gate, once per device index (it does not change)."""
    if torch.version.hip is not None:
        return "ROCm: the kernel is compiled and checked for NVIDIA GPUs only"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _GPU_REASONS:
        _GPU_REASONS[index] = capability_reason(torch.cuda.get_device_name(index),
                                                *torch.cuda.get_device_capability(index))
    return _GPU_REASONS[index]


def capability_reason(name: str, major: int, minor: int) -> Optional[str]:
    """Why the kernel does not run on compute capability ``major.minor`` (``None``: it does)."""
    if major * 10 + minor in COMPILE_TARGETS:
        return None
    targets = ", ".join(f"sm_{t}" for t in COMPILE_TARGETS)
    return (f"{name} (compute capability {major}.{minor}): the kernel is compile-checked for {targets} only "
            "(tests/ops/test_triton_compile.py)")


def triton_version_reason(version: str) -> Optional[str]:
    """Why the kernel does not run with this Triton version (``None``: it does)."""
    if parse_version(version) in TRITON_VERSIONS:
        return None
    checked = ", ".join(f"{major}.{minor}" for major, minor in TRITON_VERSIONS)
    return (f"triton {version}: the kernel's compile matrix is clean with triton {checked} only "
            "(tests/ops/test_triton_compile.py)")


# ---------------------------------------------------------------------- launches
@dataclass(frozen=True)
class _Plan:
    """One launch, sized from the arguments alone."""

    sizes: tuple  # the kernel's arguments from ``height`` to ``scale``, in its order
    num_heads: int
    groups: int  # G: the grid is (nH, G)
    window: int
    channels: int  # C = nH * head_dim


def _plan(qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int, shift: int,
          table_window: int, num_heads: int, scale: float, windows_per_program: Optional[int] = None) -> _Plan:
    """Check the arguments' shapes (``ValueError`` naming the culprit) and size the launch (the
    gate, :func:`unsupported_reason`, is asked by the callers: once per call or per stage)."""
    if qkv.dim() != 3:
        raise ValueError(f"qkv must be (B, H * W, 3C), got shape {tuple(qkv.shape)}")
    if height <= 0 or width <= 0:
        raise ValueError(f"height and width must be > 0, got height={height}, width={width}")
    if qkv.shape[1] != height * width:
        raise ValueError(f"qkv has {qkv.shape[1]} tokens, but height * width = {height} * {width} = {height * width}")
    if num_heads <= 0 or qkv.shape[2] % (3 * num_heads):
        raise ValueError(f"qkv's {qkv.shape[2]} channels are not 3 * num_heads * head_dim for num_heads={num_heads}")
    if not 0 < window <= table_window:
        raise ValueError(f"window must be in 1..table_window={table_window}, got window={window}")
    if not 0 <= shift < window:
        raise ValueError(f"shift must be in 0..window-1={window - 1}, got shift={shift}")
    rows = (2 * table_window - 1) ** 2
    if table.shape != (rows, num_heads):
        raise ValueError(f"table must be ((2 * table_window - 1) ** 2, num_heads) = ({rows}, {num_heads}), "
                         f"got {tuple(table.shape)}")
    if table.device != qkv.device:
        raise ValueError(f"table is on {table.device}, qkv on {qkv.device}")
    if windows_per_program is not None and windows_per_program <= 0:
        raise ValueError(f"windows_per_program must be > 0, got {windows_per_program}")

    head_dim = qkv.shape[2] // (3 * num_heads)
    padded_h, padded_w = _ceil_div(height, window) * window, _ceil_div(width, window) * window
    windows_per_row = padded_w // window
    windows_per_image = (padded_h // window) * windows_per_row
    total = qkv.shape[0] * windows_per_image
    if windows_per_program is None:
        groups = max(1, min(total, _ceil_div(TARGET_PROGRAMS, num_heads)))
        windows_per_program = _ceil_div(total, groups)
    windows_per_program = max(1, min(windows_per_program, total))
    sizes = (height, width, padded_h, padded_w, window, shift, table_window, windows_per_image, windows_per_row,
             total, windows_per_program, num_heads, head_dim, window * window, float(scale) * 1.4426950408889634,
             float(scale))
    return _Plan(sizes, num_heads, groups=max(1, _ceil_div(total, windows_per_program)), window=window,
                 channels=num_heads * head_dim)


def _input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot`` precision: TF32 only for fp32 where torch allows it for matmuls."""
    if dtype != torch.float32 or device.type != "cuda":
        return "ieee"
    return "tf32" if matmul_allows_tf32() else "ieee"


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned (the pointer-aligned variant the compile test builds)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _launch(plan: _Plan, qkv: torch.Tensor, table: torch.Tensor, io: torch.Tensor, grad_qkv: Optional[torch.Tensor],
            dbias: Optional[torch.Tensor]) -> None:
    # Triton launches on the current CUDA device: make it qkv's (else cuda:1 data read on cuda:0).
    device = torch.cuda.device(qkv.device) if qkv.device.type == "cuda" else contextlib.nullcontext()
    with device:
        _kernel()[(plan.num_heads, plan.groups)](
            qkv, table, io,
            grad_qkv if grad_qkv is not None else qkv,  # unused in the forward
            dbias if dbias is not None else table,  # unused in the forward
            *plan.sizes,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, INPUT_PRECISION=_input_precision(qkv.dtype, qkv.device),
            BACKWARD=grad_qkv is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )


def _forward(qkv: torch.Tensor, table: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The forward launch: ``(B, H * W, C)`` output for ``qkv`` and ``table``."""
    qkv, table = _aligned(qkv), _aligned(table)
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1], plan.channels)
    _launch(plan, qkv, table, out, None, None)
    return out


def _backward(
    grad_out: torch.Tensor, qkv: torch.Tensor, table: torch.Tensor, plan: _Plan, need_table: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The backward launch: gradients of ``qkv`` and (if ``need_table``) of ``table``."""
    qkv, table = _aligned(qkv), _aligned(table)
    grad_qkv = torch.empty_like(qkv)  # every element is written: each real token once
    n = plan.window * plan.window
    # The per-group table gradient is always written (one kernel variant); reduced only if needed.
    dbias = torch.empty(plan.groups, plan.num_heads, n, n, device=qkv.device, dtype=torch.float32)
    _launch(plan, qkv, table, _aligned(grad_out), grad_qkv, dbias)
    if not need_table:
        return grad_qkv, None
    per_pair = dbias.sum(0).permute(1, 2, 0).reshape(n * n, plan.num_heads)  # fixed order
    index = relative_position_index(plan.window, plan.sizes[6], qkv.device)
    grad_table = torch.zeros(table.shape, device=table.device, dtype=torch.float32)
    grad_table.index_put_((index,), per_pair, accumulate=True)
    return grad_qkv, grad_table.to(table.dtype)


class _TritonWindowAttention(torch.autograd.Function):
    """Fused window attention in eager mode; saves only ``qkv`` and ``table`` for backward."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, table: torch.Tensor, plan: _Plan):
        ctx.save_for_backward(qkv, table)
        ctx.plan = plan
        return _forward(qkv, table, plan)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, table = ctx.saved_tensors
        grad_qkv, grad_table = _backward(grad_out, qkv, table, ctx.plan, ctx.needs_input_grad[1])
        return grad_qkv, grad_table, None


def triton_window_attention(qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int, shift: int,
                            table_window: int, num_heads: int, scale: float, *,
                            windows_per_program: Optional[int] = None) -> torch.Tensor:
    """Fused shifted-window attention (eager; :mod:`.triton_ops` wraps it for ``torch.compile``):
    :func:`~swin_backbone.ops.attention.reference_window_attention` between its projections,
    differentiable in ``qkv`` and ``table``; ``ValueError`` on bad arguments (no fallback).

    ``qkv`` ``(B, H * W, 3C)`` row-major (``[q | k | v]``, head-major) -> ``(B, H * W, C)``;
    ``table`` ``((2 * table_window - 1) ** 2, nH)``, read in fp32; ``window <= table_window``.
    """
    plan = _plan(qkv, table, height, width, window, shift, table_window, num_heads, scale, windows_per_program)
    reason = unsupported_reason(qkv, window, num_heads, height=height, width=width)
    if reason is not None:
        raise ValueError(f"triton_window_attention cannot run here: {reason}")
    return _TritonWindowAttention.apply(qkv, table, plan)


# ---------------------------------------------------------------------- the check at first use
#: Largest error against the float64 reference, relative to its largest magnitude.
TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 5e-3, "bf16": 3e-2}

#: (batch, height, width, window, shift, table_window, heads, head_dim, windows per program):
#: padding both ways, all nine shift regions, partial and multi-window programs.
CHECK_PROBLEM = (2, 9, 11, 7, 3, 7, 2, 32, 3)

#: Per (device, dtype, precision): ``None`` (passed) or what failed. In this process only.
_VERIFIED: Dict[Tuple[str, torch.dtype, str], Optional[str]] = {}


def verify_once(device: torch.device, dtype: torch.dtype) -> None:
    """Check the kernel's forward and backward on :data:`CHECK_PROBLEM` against the float64 CPU
    reference, once per process per (device, dtype, TF32 setting); ``RuntimeError`` naming what
    failed. Every launch of a dtype is the same variant, so this runs the binary later ones run."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    precision = _input_precision(dtype, device)
    key = (f"{device}{'/interpreter' if _interpreting() else ''}", dtype, precision)
    if key not in _VERIFIED:
        _VERIFIED[key] = _check(device, dtype)
    failure = _VERIFIED[key]
    if failure is not None:
        name = _DTYPES.get(dtype, str(dtype).replace("torch.", ""))
        name = "fp32 with TF32" if precision == "tf32" else name
        raise RuntimeError(f"attention='triton': the fused Triton kernel failed its check against the reference "
                           f"on {_describe(device)} {name}: {failure}")


def _describe(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{device} (Triton interpreter)" if _interpreting() else str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"


def reference_attention(qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int, shift: int,
                        table_window: int, num_heads: int, scale: float) -> torch.Tensor:
    """:func:`triton_window_attention` by the plain-torch reference: ``(B, H * W, 3C)`` ->
    ``(B, H * W, C)``. Token indices ride in channel 0 and "project" to their ``qkv`` row
    (padding: index 0, a zero row)."""
    batch, tokens, channels = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    rows = torch.cat([qkv.new_zeros(batch, 1, 3 * channels), qkv], 1)
    index = torch.zeros(batch, tokens, channels, dtype=torch.float64, device=qkv.device)
    index[..., 0] = torch.arange(1, tokens + 1, dtype=torch.float64, device=qkv.device)

    def project(windows: torch.Tensor) -> torch.Tensor:  # (B, nW, N, C) token indices -> (B, nW, N, 3C)
        images = torch.arange(batch, device=qkv.device).view(batch, *([1] * (windows.dim() - 2)))
        return rows[images, windows[..., 0].long()]

    return reference_window_attention(index, project, nn.Identity(), table.to(qkv.dtype), table_window, height, width,
                                      window, shift, num_heads, scale)


def _check(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """:func:`verify_once`'s comparison: ``None`` if it passes, else what failed."""
    batch, height, width, window, shift, table_window, heads, head_dim, per_program = CHECK_PROBLEM
    reason = static_reason(dtype, device, window, heads, head_dim, height=height, width=width)
    if reason is not None:
        return f"it cannot run here: {reason}"
    channels, tokens = heads * head_dim, height * width
    generator = torch.Generator().manual_seed(0)  # a CPU generator of its own: the user's streams are untouched
    qkv64 = torch.randn(batch, tokens, 3 * channels, generator=generator, dtype=torch.float64)
    table64 = torch.randn((2 * table_window - 1) ** 2, heads, generator=generator, dtype=torch.float64)
    grad64 = torch.randn(batch, tokens, channels, generator=generator, dtype=torch.float64)
    # The reference reads the kernel's rounded inputs, so only the kernel's own error counts.
    qkv64, grad64 = qkv64.to(dtype).double(), grad64.to(dtype).double()
    table64 = table64.float().double()
    scale = head_dim ** -0.5
    name = "tf32" if _input_precision(dtype, device) == "tf32" else _DTYPES[dtype]
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            qkv = qkv64.to(device, dtype).requires_grad_()
            table = table64.to(device, torch.float32).requires_grad_()
            out = triton_window_attention(qkv, table, height, width, window, shift, table_window, heads, scale,
                                          windows_per_program=per_program)
            got = (out,) + torch.autograd.grad(out, (qkv, table), grad64.to(device, dtype))
            got = [t.detach().double().cpu() for t in got]  # (waits for the device: faults surface here)
    except Exception as error:  # noqa: BLE001 - any failure of the kernel is the answer
        return f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"

    with torch.inference_mode(False), torch.enable_grad():
        leaf, table_leaf = qkv64.clone().requires_grad_(), table64.clone().requires_grad_()
        expected = reference_attention(leaf, table_leaf, height, width, window, shift, table_window, heads, scale)
        expected = (expected.detach(),) + torch.autograd.grad(expected, (leaf, table_leaf), grad64)
    tolerance = TOLERANCE[name]
    for what, a, b in zip(("output", "grad qkv", "grad table"), got, expected):
        error = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if not error <= tolerance:  # (NaN fails too)
            return f"{what} off by {error:.2e} of its largest magnitude (tolerance {tolerance:.0e})"
    return None
