"""A stage's plan: its window layouts and the attention kernel that runs it.

A forward's plan may leave the kernel open (``attention="auto"`` on CUDA, or ``"triton"``
forced, which must still be checked): :func:`plan_stage` settles it once per stage, before
the blocks run, so that :func:`~swin_backbone.ops.norm_qkv` and
:func:`~swin_backbone.ops.window_attention` only read ``plan.attention``. The measurement
itself (verification against a float32 reference, timing) is :mod:`.kernel_choice`'s; this
module builds its candidates from the stage's first block.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from ..torch_compat import HAS_CUSTOM_OP, assume_constant_result, has_fp32_precision, matmul_allows_tf32
from . import kernel_choice
from .attention import window_attention
from .planner import Plan
from .image_sizes import get_image_windows
from .layouts import WindowLayout, build_window_layout, get_window_layout, register_cache, window_partition


@dataclass(frozen=True)
class AttentionInputs:
    """What a block's window attention reads, for measuring kernels on real values."""

    qkv: torch.Tensor  #: ``(B, H * W, 3C)`` row-major projected tokens (V2: cosine-prepared)
    table: torch.Tensor  #: ``((2 * tw - 1) ** 2, nH)`` relative position bias table
    table_window: int  #: ``tw``
    num_heads: int  #: ``nH``
    scale: float  #: query scale


def stage_layouts(height: int, width: int, window: int, shift: int, mask_padding: bool, device: torch.device,
                  plan: Plan) -> Tuple[WindowLayout, Optional[WindowLayout]]:
    """The cached (regular, shifted) layouts of a stage's map; ``None`` for no shift.

    With the plan's ``valid_sizes`` (per image, on this map) each layout also carries the
    windows that the images' boundaries cut (:class:`~swin_backbone.ops.layouts.ImageWindows`).
    """
    def layout(offset: int) -> WindowLayout:
        args = (height, width, window, offset, mask_padding, device, plan.mask_dtype, plan.align_masks)
        return build_window_layout(*args, tracing=True) if plan.tracing else get_window_layout(*args)

    regular, shifted = layout(0), layout(shift) if shift > 0 else None
    if plan.valid_sizes is None:
        return regular, shifted
    return _with_images(regular, plan), None if shifted is None else _with_images(shifted, plan)


def _with_images(layout: WindowLayout, plan: Plan) -> WindowLayout:
    """``layout`` with the windows the plan's per-image valid sizes cut (if any).

    The copy shares ``layout.tensors``: what either builds on first use serves both (and the
    cached layout keeps it for the next batch of this size)."""
    images = get_image_windows(layout.height, layout.width, layout.window, layout.shift, plan.valid_sizes,
                               layout.device, plan.mask_dtype, plan.align_masks)
    return layout if images is None else dataclasses.replace(layout, images=images)


def plan_stage(plan: Plan, height: int, width: int, window: int, shift: int, mask_padding: bool, num_heads: int,
               channels: int, device: torch.device,
               probe: Callable[[], AttentionInputs]) -> Tuple[Plan, WindowLayout, Optional[WindowLayout]]:
    """``(plan, regular, shifted)``: a stage's layouts and its share of the forward's plan with
    ``plan.attention`` naming a kernel. ``window`` and ``shift`` are the effective ones; ``probe``
    gives the stage's first block's :class:`AttentionInputs` on the stage's input, called only
    when a kernel is measured (once per signature and process)."""
    regular, shifted = stage_layouts(height, width, window, shift, mask_padding, device, plan)
    if plan.attention not in ("auto", "triton"):
        return plan, regular, shifted
    # "triton" in a plan made by plan_for (tests, direct use) is an instruction; from the
    # backbone's attention='triton' it is a request that is verified once.
    forced = plan.attention == "triton" and plan.attention_mode == "triton"
    instructed = plan.attention == "triton" and not forced
    head_dim = channels // num_heads
    fallback = "plain" if plan.tracing and plan.grad else "sdpa"
    shape = _shape_reason(window, head_dim, height, width, mask_padding)
    if shape is not None:
        if not instructed:
            _say_once(f"the fused Triton kernel does not cover {shape}: SDPA runs it",
                      logging.WARNING if forced else logging.INFO)
        return dataclasses.replace(plan, attention=fallback), regular, shifted
    dtype = str(plan.mask_dtype).replace("torch.", "")
    reason = _static_reason(dtype, device.type, device.index, window, num_heads, head_dim)
    if reason:
        if forced:
            raise RuntimeError(f"attention='triton' (or {kernel_choice.ENV_VAR}=triton): the fused Triton kernel "
                               f"cannot run here: {reason}")
        return dataclasses.replace(plan, attention=fallback), regular, shifted
    if instructed:
        return plan, regular, shifted
    if plan.tracing or _capturing(device):
        kernel, warps = _traced_choice(dtype, device.type, device.index, window, num_heads, head_dim, plan.grad,
                                       plan.valid_sizes is not None, forced).split(":")
        if kernel == "triton" and plan.tracing and not HAS_CUSTOM_OP:
            _say_once("the fused Triton kernel inside torch.compile graphs needs torch.library.custom_op "
                      "(torch >= 2.4): compiled graphs use plain attention", logging.WARNING)
            kernel = fallback
        kernel = fallback if kernel == "sdpa" else kernel
        return dataclasses.replace(plan, attention=kernel, triton_warps=int(warps)), regular, shifted
    sig = _signature(plan.mask_dtype, device, window, num_heads, head_dim, plan.grad, plan.valid_sizes is not None)
    layout = shifted if shifted is not None else regular  # the shift masks are what can go wrong
    memo: dict = {}

    def inputs() -> AttentionInputs:  # computed once, shared by the reference and the candidates
        if "inputs" not in memo:
            with torch.no_grad():
                memo["inputs"] = probe()
        return memo["inputs"]

    choice = kernel_choice.decide(sig, lambda: _candidates(inputs, layout, plan, sig),
                                  lambda: _reference(inputs, layout, plan), _timer(device), forced=forced)
    return dataclasses.replace(plan, attention=choice.kernel, triton_warps=choice.warps,
                               attention_signature=sig), regular, shifted


def finish_forward(plan: Plan) -> None:
    """At the end of a model forward: under ``torch.distributed``, the first training forward
    adopts rank 0's kernel decisions (:meth:`.kernel_choice.Decisions.sync_after_forward`)."""
    if plan.attention == "auto" and not plan.tracing:
        kernel_choice.DECISIONS.sync_after_forward(plan.device, plan.mask_dtype, plan.grad)


# ------------------------------------------------------------------------------ helpers


def _shape_reason(window: int, head_dim: int, height: int, width: int, mask_padding: bool) -> Optional[str]:
    from .triton_attention import MAX_HEAD_DIM, MAX_TOKENS

    if window * window > MAX_TOKENS:
        return f"window {window} (at most {int(MAX_TOKENS ** 0.5)})"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} (at most {MAX_HEAD_DIM})"
    # A map whose size is unknown (symbolic while tracing) may need padding.
    unpadded = isinstance(height, int) and isinstance(width, int) and height % window == 0 and width % window == 0
    if not mask_padding and not unpadded:
        return "mask_padding=False on a padded map"
    return None


_SAID: set = set()


def _say_once(message: str, level: int) -> None:
    if message not in _SAID:
        _SAID.add(message)
        kernel_choice._log(message, level)


@register_cache
@lru_cache(maxsize=16)
def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def _signature(dtype: torch.dtype, device: torch.device, window: int, num_heads: int, head_dim: int,
               training: bool, valid_sizes: bool) -> kernel_choice.Signature:
    precision = "-" if dtype != torch.float32 else (
        "tf32" if device.type == "cuda" and matmul_allows_tf32() else "ieee")
    return kernel_choice.Signature(_device_name(device), str(dtype).replace("torch.", ""), precision, window, num_heads,
                                   head_dim, training, valid_sizes)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@assume_constant_result  # a constant of a traced graph
def _static_reason(dtype: str, device_type: str, device_index: Optional[int], window: int, num_heads: int,
                   head_dim: int) -> str:
    """Why the fused kernel cannot run on this device / dtype / triton ('' if it can)."""
    from .triton_attention import _interpreting

    return _static_reason_cached(dtype, device_type, device_index, window, num_heads, head_dim, _interpreting())


@register_cache
@lru_cache(maxsize=256)
def _static_reason_cached(dtype: str, device_type: str, device_index: Optional[int], window: int, num_heads: int,
                          head_dim: int, interpreting: bool) -> str:
    """:func:`_static_reason`, once per situation (``interpreting``, which tests switch, is
    part of the key only)."""
    from .triton_attention import static_reason

    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    return static_reason(getattr(torch, dtype), device, window, num_heads, head_dim) or ""


@assume_constant_result  # a constant of a traced graph: no guard on the decisions
def _traced_choice(dtype: str, device_type: str, device_index: Optional[int], window: int, num_heads: int,
                   head_dim: int, training: bool, valid_sizes: bool, forced: bool) -> str:
    """``'kernel:warps'`` for a traced graph (or a captured CUDA graph): the eager decision
    for this signature if one was made, the fused kernel if forced, else SDPA."""
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    sig = _signature(getattr(torch, dtype), device, window, num_heads, head_dim, training, valid_sizes)
    choice = kernel_choice.known(sig)
    if choice is not None:
        return f"{choice.kernel}:{choice.warps}"
    return "triton:0" if forced else "sdpa:0"


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        return kernel_choice.cuda_timer

    def cpu_timer(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return cpu_timer


def _runner(kernel: str, warps: int, layout: WindowLayout, inputs: AttentionInputs,
            plan: Plan) -> Callable[[], kernel_choice.Outputs]:
    """``kernel`` on detached copies of ``inputs`` (row-major ``qkv``, partitioned first for the
    kernels that read window order), as :func:`swin_backbone.ops.window_attention` runs it: the
    output and, in training (``plan.grad``), the gradients of ``qkv`` and the table for a fixed
    random output gradient."""
    stage_plan = dataclasses.replace(plan, attention=kernel, triton_warps=warps, attention_signature=None,
                                     save_memory=False)

    def run() -> kernel_choice.Outputs:
        qkv, table = inputs.qkv.detach(), inputs.table.detach()
        if plan.grad:
            qkv, table = qkv.clone().requires_grad_(), table.clone().requires_grad_()
        with torch.enable_grad() if plan.grad else torch.no_grad():
            rows = qkv if kernel == "triton" else window_partition(qkv, layout)
            out = window_attention(rows, table, inputs.table_window, layout, inputs.num_heads, inputs.scale, 0.0,
                                   stage_plan)
            if not plan.grad:
                return out, None, None
            generator = torch.Generator(device=out.device).manual_seed(0)
            grad_out = torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float32)
            grad_qkv, grad_table = torch.autograd.grad(out, (qkv, table), grad_out.to(out.dtype))
        return out, grad_qkv, grad_table

    return run


def _candidates(inputs: Callable[[], AttentionInputs], layout: WindowLayout, plan: Plan,
                sig: kernel_choice.Signature) -> List[kernel_choice.Candidate]:
    """SDPA and the fused kernel at each ``num_warps`` worth trying, on the probe's inputs."""
    from .triton_attention import warps_choices

    # The fused kernel first: it wins a tie (it saves the partition gathers around SDPA).
    options = [(f"triton/warps{w}", "triton", w) for w in warps_choices(sig.window)] + [("sdpa", "sdpa", 0)]
    return [kernel_choice.Candidate(name, kernel, _runner(kernel, warps, layout, inputs(), plan), warps)
            for name, kernel, warps in options]


def _reference(inputs: Callable[[], AttentionInputs], layout: WindowLayout, plan: Plan) -> kernel_choice.Outputs:
    """The float32 reference: matmul + softmax with autograd, TF32 off, on the probe's inputs."""
    got = inputs()
    fp32 = AttentionInputs(got.qkv.float(), got.table.float(), got.table_window, got.num_heads, got.scale)
    plan32 = dataclasses.replace(plan, mask_dtype=torch.float32, chunk_bytes=0, fixup_share=0.0)
    layout32 = get_window_layout(layout.height, layout.width, layout.window, layout.shift, layout.padding_masked,
                                 layout.device, torch.float32, plan.align_masks)
    if layout.images is not None:
        layout32 = _with_images(layout32, plan32)
    with _ieee_fp32(), torch.autocast(layout.device.type, enabled=False):
        return _runner("plain", 0, layout32, fp32, plan32)()


@contextlib.contextmanager
def _ieee_fp32() -> Iterator[None]:
    """fp32 matmuls without TF32 inside (restored after)."""
    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if has_fp32_precision(matmul) else "allow_tf32"
    old = getattr(matmul, name)
    setattr(matmul, name, "ieee" if name == "fp32_precision" else False)
    try:
        yield
    finally:
        setattr(matmul, name, old)
