"""The one place that decides how a forward is computed (docs/design.md, "The planner").

:func:`plan_forward` returns a :class:`Plan` once per forward; :func:`plan_stage` adds a stage's
window layouts; :func:`override` switches optimisations off for ablations (docs/performance.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from mmengine.logging import print_log
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from ..torch_compat import compute_dtype, is_compiling
from .image_sizes import get_image_windows, stage_valid_sizes
from .layouts import WindowLayout, build_window_layout, get_window_layout, register_cache
from .windows import output_size

#: Window-attention kernels (:mod:`swin_backbone.ops.attention`).
ATTENTION_KERNELS = ("sdpa", "plain", "recompute", "triton")

#: The backbone's ``attention`` argument (``'auto'`` = ``'sdpa'``; ``'triton'``: docs/gpu-kernel.md).
ATTENTION_CHOICES = ("auto", "sdpa", "triton")

ENV_VAR = "SWIN_BACKBONE_ATTENTION"  #: overrides every backbone's ``attention`` argument

#: Operators whose outputs selective checkpointing keeps (matmuls: their recomputation costs).
SAVED_OPS = [torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default]

#: Torch's selective activation checkpointing (torch >= 2.4), else ``None``.
_SAC = getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None)
_SAVE_MATMULS = None if _SAC is None else functools.partial(_SAC, SAVED_OPS)


@dataclass(frozen=True)
class Switches:
    """What :func:`plan_forward` may use (an ablation turns each off: False, 0)."""

    sdpa: bool = True  #: fused SDPA kernels (else matmul + softmax)
    recompute_attention: bool = True  #: CPU training: hand-written attention backward (else autograd)
    save_memory: bool = True  #: training: selective activation checkpointing (qkv projection, MLP branch)
    chunk_bytes: Optional[int] = None  #: CPU row chunks (None: :func:`cpu_chunk_bytes`; 0: whole tensors)
    align_masks: Optional[bool] = None  #: 8-aligned mask rows for fused CUDA kernels (None: on CUDA)


_SWITCHES = Switches()


@contextlib.contextmanager
def override(**changes) -> Iterator[Switches]:
    """Temporarily change :class:`Switches` (for ablations and tests)."""
    global _SWITCHES
    old = _SWITCHES
    _SWITCHES = dataclasses.replace(old, **changes)
    try:
        yield _SWITCHES
    finally:
        _SWITCHES = old


def resolve_attention(value: object, name: str = "attention") -> str:
    """The attention mode in force: :data:`ENV_VAR` if set, else ``value`` (checked)."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        if env not in ATTENTION_CHOICES:
            raise ValueError(f"{ENV_VAR}: expected one of {ATTENTION_CHOICES}, got {env!r}")
        return env
    if not isinstance(value, str) or value not in ATTENTION_CHOICES:
        raise ValueError(f"{name}: expected one of {ATTENTION_CHOICES}, got {value!r}")
    return value


def cpu_chunk_bytes() -> int:
    """Bytes of a CPU row chunk: twice the L2 cache of the cores torch uses, within 4-16 MiB
    (not the L3: virtual machines report the whole host's)."""
    try:
        l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError):
        l2 = 0
    l2 = l2 if l2 > 0 else 2**20
    return int(min(16 * 2**20, max(4 * 2**20, 2 * l2 * torch.get_num_threads())))


def chunk_slices(total: int, step: int) -> List[slice]:
    """Slices of ``range(total)``, at most ``step`` long, as even as possible (a short tail's
    matmuls run at a lower rate)."""
    count = max(1, -(-total // max(step, 1)))
    base, extra = divmod(total, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


# ------------------------------------------------------------------------------ plain modules
#: torch modules the fast paths may call piece by piece: exact types (a subclass, a quantized,
#: adapted or parametrized layer may compute something else on a part of its input).
PLAIN_TORCH_MODULES = (nn.Linear, nn.LayerNorm, nn.GELU, nn.Dropout, nn.Identity, nn.Conv2d, nn.ReLU, nn.ModuleList,
                       nn.Sequential)
#: The package's own module classes (registered by swin_backbone.model), exact types too.
PLAIN_SWIN_MODULES: List[type] = []


def plain_modules(model: nn.Module) -> bool:
    """Whether every submodule of ``model`` is exactly a plain class holding ``nn.Parameter``s
    (``functional_call`` swaps in tensors for one call), with no forward hook: the condition for
    calling a module on part of its input, again in backward, or adding into its output in place."""
    module_hooks = nn.modules.module
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return False
    plain = PLAIN_TORCH_MODULES + tuple(PLAIN_SWIN_MODULES)
    return all(type(m) in plain and not m._forward_hooks and not m._forward_pre_hooks
               and all(p is None or isinstance(p, nn.Parameter) for p in m._parameters.values())
               for m in model.modules() if m is not model)


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Plan:
    """How one forward (or one stage of it) is computed (the situations: docs/design.md, "The planner")."""

    device: str  #: ``'cpu'``, ``'cuda'``, ...
    mask_dtype: torch.dtype  #: dtype of cached masks: the compute dtype (the autocast dtype under autocast)
    #: masks and biases handed to SDPA have 8-aligned rows (CUDA kernels copy misaligned ones on every call)
    align_masks: bool
    grad: bool  #: autograd records this forward (some input or parameter requires grad)
    #: ``torch.compile``, ``torch.export`` or ``torch.jit.trace``: plain torch ops only
    tracing: bool
    dropout: bool  #: dropout after the position embedding, projection and MLP is active
    stochastic: bool  #: any dropout or stochastic depth is active (training mode, rate > 0)
    attn_dropout: bool  #: attention dropout is active
    attention: str  #: one of :data:`ATTENTION_KERNELS` (``'triton'`` is checked per stage: :func:`plan_stage`)
    #: training with plain modules: selective checkpointing (:func:`checkpointed`, :func:`mlp_residual`)
    save_memory: bool
    chunk_bytes: int  #: CPU row-chunk size in bytes, 0 for whole tensors
    #: :func:`plain_modules`: residuals may be added into a branch's output in place
    plain: bool = False
    #: CPU inference with plain modules: row-wise modules run ``chunk_bytes`` of rows at a time
    chunked: bool = False
    #: per image, its ``(h, w)`` on this plan's map (pixels / tokens); ``None``: all fill it
    valid_sizes: Optional[Tuple[Tuple[int, int], ...]] = None
    #: the forward's plan only: ``valid_sizes`` of each stage's map, ``None`` where all fill it
    stage_valid_sizes: Optional[Tuple[Optional[Tuple[Tuple[int, int], ...]], ...]] = None

    def for_stage(self, x: torch.Tensor, stage: nn.Module, index: int = 0) -> "Plan":
        """The plan for stage ``index`` (frozen stages run like inference), with its valid sizes."""
        plan = self
        if self.grad and not self.tracing and not x.requires_grad and not any(
                p.requires_grad for p in stage.parameters()):
            mode = "triton" if self.attention == "triton" else "auto"
            plan = decide(self.device, self.mask_dtype, False, False, self.dropout, self.stochastic, self.attn_dropout,
                          mode)
            plan = dataclasses.replace(plan, plain=self.plain,
                                       chunked=self.plain and plan.chunk_bytes > 0 and not self.stochastic)
        valid = None if self.stage_valid_sizes is None else self.stage_valid_sizes[index]
        if valid is None and plan.valid_sizes is None and plan.stage_valid_sizes is None:
            return plan
        return dataclasses.replace(plan, valid_sizes=valid, stage_valid_sizes=None)


def tracing() -> bool:
    """Whether a tracer records this forward (dynamo or TorchScript)."""
    return is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting()


def plan_forward(
    x: torch.Tensor, model: nn.Module, attn_dropout: bool, dropout: bool, drop_path: bool,
    valid_sizes: Optional[Tuple[Tuple[int, int], ...]] = None, attention: str = "auto",
) -> Plan:
    """Decide how ``model`` computes its forward on ``x``; ``valid_sizes``: per-image ``(h, w)``
    in input pixels (``model`` then needs ``patch_size`` and ``stages``)."""
    stochastic = attn_dropout or dropout or drop_path
    device, dtype, grad = x.device.type, compute_dtype(x), torch.is_grad_enabled()
    if tracing():
        if valid_sizes is not None:
            raise ValueError("valid_sizes: expected None while tracing (torch.compile / torch.export / "
                             "torch.jit.trace); per-image valid sizes run eagerly")
        return _decide(device, dtype, grad, True, dropout, stochastic, attn_dropout, attention, _SWITCHES)
    grad = grad and (x.requires_grad or any(p.requires_grad for p in model.parameters()))
    plan = decide(device, dtype, grad, False, dropout, stochastic, attn_dropout, attention)
    plain = plain_modules(model)
    # Checkpointing and row chunks call modules more than once: exact only for plain modules.
    plan = dataclasses.replace(plan, plain=plain, save_memory=plan.save_memory and plain,
                               chunked=plain and plan.chunk_bytes > 0 and not grad and not stochastic)
    if valid_sizes is None:
        return plan
    maps = output_size(x.shape[-2], x.shape[-1], model.patch_size, len(model.stages))
    per_stage = stage_valid_sizes(valid_sizes, model.patch_size, len(model.stages))
    return dataclasses.replace(plan, valid_sizes=valid_sizes, stage_valid_sizes=tuple(
        None if all(v == m for v in sizes) else sizes for m, sizes in zip(maps, per_stage)))


def plan_for_module(x: torch.Tensor, module: nn.Module) -> Plan:
    """The plan for calling one of the model's modules on its own (dropout read off it)."""
    active = module.training
    dropout = active and any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())
    drop_path = active and any(getattr(m, "drop_prob", 0.0) > 0 for m in module.modules())  # DropPath
    attn = active and any(getattr(m, "attn_drop_rate", 0.0) > 0 for m in module.modules())
    return plan_forward(x, module, attn, dropout, drop_path)


def decide(device: str, mask_dtype: torch.dtype, grad: bool, tracing: bool, dropout: bool, stochastic: bool,
           attn_dropout: bool, attention: str = "auto") -> Plan:
    """:func:`plan_forward`'s decision from the situation alone (cached)."""
    return _decide_cached(device, mask_dtype, grad, tracing, dropout, stochastic, attn_dropout, attention, _SWITCHES)


def _decide(device: str, mask_dtype: torch.dtype, grad: bool, tracing: bool, dropout: bool, stochastic: bool,
            attn_dropout: bool, mode: str, s: Switches) -> Plan:
    cpu = device == "cpu"
    if mode == "triton" and device == "cuda" and not attn_dropout:
        attention = "triton"  # opt-in; checked and verified per stage (plan_stage)
    elif tracing:
        # TorchScript exporters and FLOP counters read matmuls; torch.compile fuses them itself.
        attention = "plain" if grad or attn_dropout or not s.sdpa or torch.jit.is_tracing() else "sdpa"
    elif attn_dropout or not s.sdpa:
        attention = "plain"
    elif grad and cpu:
        # CPU SDPA gives no bias gradient: SDPA forward with a hand-written backward instead.
        attention = "recompute" if s.recompute_attention else "plain"
    else:
        # CUDA: memory-efficient SDPA, which takes a float bias and computes its gradient.
        attention = "sdpa"
    eager = not tracing
    return Plan(
        device=device, mask_dtype=mask_dtype, align_masks=device == "cuda" if s.align_masks is None else s.align_masks,
        grad=grad, tracing=tracing, dropout=dropout, stochastic=stochastic, attn_dropout=attn_dropout,
        attention=attention, save_memory=eager and grad and s.save_memory and _SAVE_MATMULS is not None,
        chunk_bytes=(cpu_chunk_bytes() if s.chunk_bytes is None else s.chunk_bytes) if eager and cpu else 0,
    )


_decide_cached = register_cache(lru_cache(maxsize=64)(_decide))  # (the switches are part of the key)


def plan_for(x: torch.Tensor, grad: Optional[bool] = None, attention: Optional[str] = None, **fields) -> Plan:
    """A plan for ``x`` with some fields forced (tests and direct use of the ops)."""
    grad = torch.is_grad_enabled() and x.requires_grad if grad is None else grad
    plan = decide(x.device.type, x.dtype, grad, False, False, False, False, "auto")
    if attention is not None:
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention: expected one of {ATTENTION_KERNELS}, got {attention!r}")
        fields["attention"] = attention
    return dataclasses.replace(plan, **fields)


# ------------------------------------------------------------------------------ a stage's plan
def plan_stage(plan: Plan, height: int, width: int, window: int, shift: int, table_window: int, mask_padding: bool,
               num_heads: int, head_dim: int, device: torch.device, with_cp: bool = False,
               ) -> Tuple[Plan, WindowLayout, Optional[WindowLayout]]:
    """``(plan, regular, shifted)``: a stage's cached window layouts (``shifted`` ``None`` without
    a shift) and its plan, with a requested Triton kernel checked (SDPA for shapes it lacks)."""
    def layout(offset: int) -> WindowLayout:
        args = (height, width, window, offset, mask_padding, device, plan.mask_dtype, plan.align_masks, plan.tracing,
                table_window)
        made = build_window_layout(*args) if plan.tracing else get_window_layout(*args)
        if plan.valid_sizes is None:
            return made
        images = get_image_windows(height, width, window, offset, plan.valid_sizes, device, plan.mask_dtype,
                                   plan.align_masks)
        return made if images is None else dataclasses.replace(made, images=images)

    regular, shifted = layout(0), layout(shift) if shift > 0 else None
    if with_cp and plan.save_memory:
        plan = dataclasses.replace(plan, save_memory=False)
    if plan.attention == "triton":
        plan = _check_triton(plan, height, width, window, mask_padding, num_heads, head_dim, device)
    return plan, regular, shifted


def _check_triton(plan: Plan, height: int, width: int, window: int, mask_padding: bool, num_heads: int, head_dim: int,
                  device: torch.device) -> Plan:
    from .triton_attention import MAX_HEAD_DIM, MAX_TOKENS, static_reason, verify_once

    if window * window > MAX_TOKENS or head_dim > MAX_HEAD_DIM or (
            not mask_padding and (height % window or width % window)):
        _say_once(f"attention='triton': the fused kernel does not cover window {window}, head_dim {head_dim}"
                  f"{'' if mask_padding else ', mask_padding=False on a padded map'}: SDPA runs that stage")
        return dataclasses.replace(plan, attention="plain" if plan.tracing and plan.grad else "sdpa")
    reason = static_reason(plan.mask_dtype, device, window, num_heads, head_dim, height=height, width=width,
                           mask_padding=mask_padding)
    if reason:
        raise RuntimeError(f"attention='triton' (or {ENV_VAR}=triton): the fused Triton kernel cannot run here: "
                           f"{reason}")
    if not plan.tracing:
        verify_once(device, plan.mask_dtype)
    return plan


_SAID: set = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        print_log(message, logger="current", level=logging.WARNING)


# ------------------------------------------------------------------------------ memory and residuals
def checkpointed(fn: Callable[..., torch.Tensor], plan: Plan, *args) -> torch.Tensor:
    """``fn(*args, plan)``, with :attr:`Plan.save_memory` under selective checkpointing (matmul
    outputs kept)."""
    if plan.save_memory:
        return torch_checkpoint.checkpoint(fn, *args, plan, use_reentrant=False, context_fn=_SAVE_MATMULS)
    return fn(*args, plan)


def mlp_residual(x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor], hidden: int,
                 plan: Plan) -> torch.Tensor:
    """``x + branch(x)`` for caller-owned ``(B, L, C)`` ``x`` and a row-wise ``branch`` (``hidden``:
    its widest width): by cache-sized row chunks into ``x`` with :attr:`Plan.chunked`, under
    selective checkpointing with :attr:`Plan.save_memory`, else one call."""
    # As rows: nn.Linear returns its own 2-d result, no view of it, so the in-place add below
    # records no CopySlices (whose backward zero-fills and copies a map-sized gradient).
    rows = x.reshape(-1, x.shape[-1])
    if plan.chunked:
        # Chunks as even as possible (a short tail's matmuls run at a lower rate).
        count = max(1, -(-rows.shape[0] * hidden * x.element_size() // plan.chunk_bytes))
        for i in range(count):
            chunk = rows[i * rows.shape[0] // count:(i + 1) * rows.shape[0] // count]
            chunk.add_(branch(chunk))
        return x
    if plan.save_memory:
        y = torch_checkpoint.checkpoint(branch, rows, use_reentrant=False, context_fn=_SAVE_MATMULS)
    else:
        y = branch(rows)
    return (y.add_(rows) if plan.plain else rows + y).view(x.shape)
