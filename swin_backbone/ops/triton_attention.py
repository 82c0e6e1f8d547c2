"""Fused shifted-window attention in Triton: forward and backward, one kernel launch each.

:func:`triton_window_attention` takes the ``(B, H * W, 3C)`` output of the qkv projection in
row-major token order and returns the ``(B, H * W, C)`` attention output in row-major order:
pad, shift, partition, region mask, relative position bias, softmax and the reverse are fused
into one pass over the windows. Whether it runs is :mod:`.kernel_choice`'s decision. Importing
this module compiles nothing and works without a GPU or triton (:func:`unsupported_reason` then
says so); the interpreter (CPU tensors, for tests) needs ``TRITON_INTERPRET=1`` before
``triton.language`` is first imported. How and why: docs/design.md, "The fused Triton kernel".
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from ..torch_compat import matmul_allows_tf32
from .layouts import get_relative_position_index

try:  # triton is optional: the module must import (and answer ``unsupported_reason``) without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

__all__ = ["triton_window_attention", "unsupported_reason", "TARGET_PROGRAMS"]

#: Program instances a launch aims for (several waves on a large GPU); windows are grouped so
#: that ``nH * G`` stays near it. Also bounds the table-gradient buffer ``(G, nH, N, N)``.
TARGET_PROGRAMS = 1024

#: Largest window size ``N = ws * ws`` a program holds in one block (``ws <= 8``): a whole
#: window's logits live in registers, and the 128- and 256-row blocks of larger windows need
#: more shared memory than GPUs have (compiler report in docs/performance.md).
MAX_TOKENS = 64

#: Oldest triton the kernel is written for (``tl.dot(input_precision=...)``).
TRITON_FLOOR = (3, 0)

#: Largest head dimension (padded up to a power of two >= 16 inside the kernel).
MAX_HEAD_DIM = 128

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _interpreting() -> bool:
    """Whether Triton kernels would run in the interpreter (read now, not at import)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _library_interpreted() -> bool:
    """Whether ``triton.language`` itself was imported with the interpreter on.

    Its own jit functions (``tl.sum``, ``tl.max``, ``tl.zeros``) are decorated when it is
    imported, in the mode then in effect: an interpreted kernel cannot call compiled-mode ones
    (they raise), so switching the interpreter on later in a process does not work.
    """
    if triton is None:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # triton < 3.0 (declined by static_reason anyway)
        return False

    return isinstance(tl.sum, InterpretedFunction)


# --------------------------------------------------------------------------------------------
# The kernel. One body for forward and backward (``BACKWARD`` is a compile-time constant):
# they share the window index math, the loads and the computation of P.
# Pointers: qkv (B, H * W, 3C) row-major, contiguous; table ((2tw-1)**2, nH) contiguous; io: the
# forward's output (B, H * W, C), the backward's gradient of it; grad_qkv: backward, (B, H * W, 3C)
# gradient of qkv (written); dbias: backward, (G, nH, N, N) fp32 per-group bias gradient (written).
# windows_per_image nW, windows_per_row Wp // ws, total_windows B * nW, seq_len N = ws * ws,
# qk_scale = scale * log2(e).
# --------------------------------------------------------------------------------------------
def _window_attention_kernel(
    qkv_ptr, table_ptr, io_ptr, grad_qkv_ptr, dbias_ptr,
    height, width, padded_h, padded_w, window, shift, table_window, windows_per_image, windows_per_row,
    total_windows, windows_per_program, num_heads, head_dim, seq_len, qk_scale, scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, BACKWARD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
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

    # Relative position bias of this head, gathered from the table once per program, in log2
    # units like the scaled logits.
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

    if BIAS_GRAD:  # backward only
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
        # Shift regions as in windows._shift_regions: rows [0, Hp-ws) -> 0, [Hp-ws, Hp-shift)
        # -> 1, [Hp-shift, Hp) -> 2 (same for columns). With shift == 0 the first test only
        # splits whole windows apart, so tokens of one window always share a region.
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
        # Rows with no key at all (padding queries of a window without real tokens of their
        # region, block rows >= N) are never stored: keep them finite, not NaN.
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        p = tl.exp2(logits - row_max[:, None])
        row_sum = tl.sum(p, axis=1)
        row_sum = tl.where(row_sum == 0.0, 1.0, row_sum)

        io_rows = io_ptr + row[:, None] * channels + q_cols[None, :]
        if BACKWARD:
            p = p / row_sum[:, None]
            grad_out = tl.load(io_rows, mask=tile_ok, other=0.0)
            # dV and dK are computed transposed, (D, N), from transposes of *loaded* tiles
            # only: a transposed dot result (P^T dO, dS^T q) fed to tl.dot is what Triton
            # miscompiles on Hopper in some versions (wrong dK without an error).
            grad_v_t = tl.dot(tl.trans(grad_out), p.to(grad_out.dtype), input_precision=INPUT_PRECISION)
            grad_p = tl.dot(grad_out, tl.trans(v), input_precision=INPUT_PRECISION)
            # Softmax backward: dS = P * (dP - rowsum(P * dP)), the gradient of the logits
            # scale * q k^T + bias (base e). Padding queries have dO = 0, so their rows are 0.
            delta = tl.sum(p * grad_p, axis=1)
            grad_s = p * (grad_p - delta[:, None])
            if BIAS_GRAD:
                dbias += grad_s
            grad_s_in = grad_s.to(q.dtype)
            grad_q = tl.dot(grad_s_in, k, input_precision=INPUT_PRECISION) * scale
            grad_k_t = tl.dot(tl.trans(q), grad_s_in, input_precision=INPUT_PRECISION) * scale
            grad_rows = grad_qkv_ptr + row[:, None] * (3 * channels)
            grad_rows_t = grad_qkv_ptr + row[None, :] * (3 * channels)  # (D, N) tiles
            tile_ok_t = col_ok[:, None] & real[None, :]
            out_ty = grad_qkv_ptr.dtype.element_ty
            tl.store(grad_rows + q_cols[None, :], grad_q.to(out_ty), mask=tile_ok)
            tl.store(grad_rows_t + k_cols[:, None], grad_k_t.to(out_ty), mask=tile_ok_t)
            tl.store(grad_rows_t + v_cols[:, None], grad_v_t.to(out_ty), mask=tile_ok_t)
        else:
            out = tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION) / row_sum[:, None]
            tl.store(io_rows, out.to(io_ptr.dtype.element_ty), mask=tile_ok)

    if BIAS_GRAD:
        slot = dbias_ptr + (group * num_heads + head).to(tl.int64) * seq_len * seq_len
        tl.store(slot + pos[:, None] * seq_len + pos[None, :], dbias, mask=pair_ok)


_JITTED: Dict[bool, object] = {}


def _kernel():
    """The kernel, jit-decorated for the current mode (compiled or interpreted) on first use."""
    interpret = _interpreting()
    if interpret not in _JITTED:
        # Triton specializes integer arguments on their values (== 1, divisible by 16): the
        # size-dependent ones would compile a new kernel for many input sizes.
        _JITTED[interpret] = triton.jit(_window_attention_kernel, do_not_specialize=_SIZE_ARGUMENTS)
    return _JITTED[interpret]


#: The kernel's arguments that vary with the input size.
_SIZE_ARGUMENTS = ("height", "width", "padded_h", "padded_w", "shift", "windows_per_image", "windows_per_row",
                   "total_windows", "windows_per_program")


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def unsupported_reason(qkv: torch.Tensor, window: int, num_heads: int, *, height: Optional[int] = None,
                       width: Optional[int] = None, mask_padding: bool = True, dropout_p: float = 0.0) -> Optional[str]:
    """Why :func:`triton_window_attention` cannot run on these inputs, or ``None`` if it can.

    Only the device, dtype and shape of ``qkv`` ``(B, H * W, 3C)`` are read. The kernel implements
    ``mask_padding=True`` (padding tokens are their own region): with ``False`` real tokens attend
    to the padding tokens' projected zeros, which it never loads, so ``height`` and ``width`` must
    rule padding out.
    """
    if qkv.dim() != 3 or num_heads <= 0 or qkv.shape[-1] % (3 * num_heads):
        return f"qkv of shape {tuple(qkv.shape)} is not (B, L, 3 * num_heads * head_dim) for num_heads={num_heads}"
    return static_reason(qkv.dtype, qkv.device, window, num_heads, qkv.shape[-1] // (3 * num_heads), height=height,
                         width=width, mask_padding=mask_padding, dropout_p=dropout_p)


def static_reason(dtype: torch.dtype, device: torch.device, window: int, num_heads: int, head_dim: int, *,
                  height: Optional[int] = None, width: Optional[int] = None, mask_padding: bool = True,
                  dropout_p: float = 0.0) -> Optional[str]:
    """:func:`unsupported_reason` from the attention's description alone (no tensor)."""
    if triton is None:
        return "triton is not installed"
    if _triton_version() < TRITON_FLOOR:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, TRITON_FLOOR))}"
    interpret = _interpreting()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
    elif not (interpret and device.type == "cpu"):
        return f"device {device.type!r} needs CUDA (or TRITON_INTERPRET=1 for CPU tensors)"
    if interpret and not _library_interpreted():
        return "TRITON_INTERPRET=1 was set after triton.language was imported (set it before)"
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    if dtype == torch.bfloat16:
        if interpret:
            return "bfloat16 tl.dot gives wrong results in the Triton interpreter"
        if torch.version.hip is None and torch.cuda.get_device_capability(device) < (8, 0):  # cuda here
            return "bfloat16 needs a GPU of compute capability >= 8.0"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    if window <= 0 or window * window > MAX_TOKENS:
        return f"window {window}: a window must hold 1..{MAX_TOKENS} tokens"
    if dropout_p > 0:
        return "no attention dropout in the kernel"
    if not mask_padding:
        if height is None or width is None:
            return "mask_padding=False needs height and width to rule out padding"
        if height % window or width % window:
            return "mask_padding=False on a padded map (real tokens attend to padding tokens, never loaded here)"
    return None


def _triton_version() -> Tuple[int, ...]:
    parts = str(getattr(triton, "__version__", "0")).split("+")[0].split(".")[:2]
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in parts)


@dataclass(frozen=True)
class _Plan:
    """One launch, sized from the arguments alone."""

    sizes: tuple  # the kernel's arguments from ``height`` to ``scale``, in its order
    num_heads: int
    groups: int  # G: the grid is (nH, G)
    window: int
    table_window: int
    channels: int  # C = nH * head_dim
    block_n: int
    block_d: int
    num_warps: int


def _plan(qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int, shift: int,
          table_window: int, num_heads: int, scale: float, windows_per_program: Optional[int],
          num_warps: int = 0) -> _Plan:
    """Validate the arguments (``ValueError`` naming the culprit) and size the launch."""
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
        raise ValueError(
            f"table must be ((2 * table_window - 1) ** 2, num_heads) = ({rows}, {num_heads}), "
            f"got {tuple(table.shape)}"
        )
    if table.device != qkv.device:
        raise ValueError(f"table is on {table.device}, qkv on {qkv.device}")
    if windows_per_program is not None and windows_per_program <= 0:
        raise ValueError(f"windows_per_program must be > 0, got {windows_per_program}")
    reason = unsupported_reason(qkv, window, num_heads, height=height, width=width)
    if reason is not None:
        raise ValueError(f"triton_window_attention cannot run here: {reason}")

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
                 table_window=table_window, channels=num_heads * head_dim, block_n=_block_n(window),
                 block_d=max(16, _next_pow2(head_dim)), num_warps=num_warps or warps_choices(window)[0])


def _block_n(window: int) -> int:
    """Rows of the block holding a window's ``N = ws * ws`` tokens."""
    return max(16, _next_pow2(window * window))


def warps_choices(window: int) -> Tuple[int, ...]:
    """The ``num_warps`` worth measuring for a window, the default first. Several ``block_n x block_n``
    fp32 tiles are live (bias, logits / P, and in the backward dP / dS and the dS accumulator), so a
    64-row block needs 8 warps to hold them without spilling; smaller blocks fit in 4."""
    return (8, 4) if _block_n(window) >= 64 else (4,)


def _input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot`` precision for fp32 inputs: TF32 only where torch itself allows it for
    matmuls (fp16 / bf16 inputs ignore the setting)."""
    if dtype != torch.float32 or device.type != "cuda":
        return "ieee"
    return "tf32" if matmul_allows_tf32() else "ieee"


def _launch(plan: _Plan, qkv: torch.Tensor, table: torch.Tensor, io: torch.Tensor, grad_qkv: Optional[torch.Tensor],
            dbias: Optional[torch.Tensor], backward: bool) -> None:
    # Triton launches on the current CUDA device: make it qkv's (a model on cuda:1 while
    # cuda:0 is current would otherwise read another GPU's addresses).
    device = torch.cuda.device(qkv.device) if qkv.device.type == "cuda" else contextlib.nullcontext()
    with device:
        _kernel()[(plan.num_heads, plan.groups)](
            qkv, table, io,
            grad_qkv if grad_qkv is not None else qkv,  # unused in the forward
            dbias if dbias is not None else table,  # unused unless BIAS_GRAD
            *plan.sizes,
            BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, INPUT_PRECISION=_input_precision(qkv.dtype, qkv.device),
            BACKWARD=backward, BIAS_GRAD=dbias is not None, num_warps=plan.num_warps, num_stages=2,
        )


def _forward(qkv: torch.Tensor, table: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The forward launch: ``(B, H * W, C)`` output for contiguous ``qkv`` and ``table``."""
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1], plan.channels)
    _launch(plan, qkv, table, out, None, None, backward=False)
    return out


def _backward(
    grad_out: torch.Tensor, qkv: torch.Tensor, table: torch.Tensor, plan: _Plan, need_table: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The backward launch: gradients of ``qkv`` and (if ``need_table``) of ``table``."""
    grad_qkv = torch.empty_like(qkv)  # every element is written: each real token once
    n = plan.window * plan.window
    dbias = None
    if need_table:
        dbias = torch.empty(plan.groups, plan.num_heads, n, n, device=qkv.device, dtype=torch.float32)
    _launch(plan, qkv, table, grad_out.contiguous(), grad_qkv, dbias, backward=True)
    if not need_table:
        return grad_qkv, None
    per_pair = dbias.sum(0).permute(1, 2, 0).reshape(n * n, plan.num_heads)  # fixed order
    index = get_relative_position_index(plan.window, plan.table_window, qkv.device)
    grad_table = torch.zeros(table.shape, device=table.device, dtype=torch.float32)
    grad_table.index_put_((index,), per_pair, accumulate=True)
    return grad_qkv, grad_table.to(table.dtype)


#: Gradients of ``qkv`` and the table computed another way, for a backward launch that fails:
#: ``(grad_out, qkv, table) -> (grad_qkv, grad_table)``.
BackwardFallback = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


class _TritonWindowAttention(torch.autograd.Function):
    """Fused window attention in eager mode; saves only ``qkv`` and ``table`` for backward."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, table: torch.Tensor, plan: _Plan, fallback: Optional[BackwardFallback]):
        qkv, table = qkv.contiguous(), table.contiguous()
        ctx.save_for_backward(qkv, table)
        ctx.plan, ctx.fallback = plan, fallback
        return _forward(qkv, table, plan)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qkv, table = ctx.saved_tensors
        try:
            grad_qkv, grad_table = _backward(grad_out, qkv, table, ctx.plan, ctx.needs_input_grad[1])
        except Exception:
            if ctx.fallback is None:
                raise
            grad_qkv, grad_table = ctx.fallback(grad_out, qkv, table)
        return grad_qkv, grad_table, None, None


def triton_window_attention(qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int, shift: int,
                            table_window: int, num_heads: int, scale: float, *,
                            windows_per_program: Optional[int] = None, num_warps: int = 0,
                            backward_fallback: Optional[BackwardFallback] = None) -> torch.Tensor:
    """Shifted-window multi-head attention with relative position bias, fused (eager; inside
    ``torch.compile`` graphs the same kernel runs as the operator of :mod:`.triton_ops`).

    Same result as partitioning ``qkv`` with ``build_window_layout(height, width, window,
    shift, mask_padding=True, ...)``, attending with the bias ``table[relative_position_index
    (window, table_window)]`` and the region mask, and reversing the windows; differentiable
    in ``qkv`` and ``table``.

    Args:
        qkv: ``(B, H * W, 3C)`` row-major tokens from the qkv projection (channels
            ``[q | k | v]``, each head-major), fp32, fp16 or bf16.
        table: ``((2 * table_window - 1) ** 2, nH)`` relative position bias table (any float
            dtype; read in fp32, its gradient returned in its own dtype).
        window, shift: effective window ``ws <= table_window`` (the window ``tw`` the table
            was built for) and shift ``0 <= shift < ws``.
        windows_per_program: windows each program handles (default: grouped so that a
            launch has about :data:`TARGET_PROGRAMS` programs).
        num_warps: Triton warps per program (0: the first of :func:`warps_choices`).
        backward_fallback: computes the gradients if the backward launch raises (else the
            error propagates).
    Returns:
        ``(B, H * W, C)`` attention output in row-major order, in ``qkv``'s dtype.
    Raises:
        ValueError: on inconsistent arguments, or inputs :func:`unsupported_reason` rejects.
    """
    plan = _plan(qkv, table, height, width, window, shift, table_window, num_heads, scale, windows_per_program,
                 num_warps)
    return _TritonWindowAttention.apply(qkv, table, plan, backward_fallback)
