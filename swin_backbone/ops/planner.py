"""The one place that decides how a forward is computed (docs/design.md, "The planner").

:func:`plan_forward` returns a :class:`Plan` once per forward; :func:`plan_stage` adds a stage's
window layouts; :func:`override` switches optimisations off for ablations (docs/performance.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..torch_compat import compute_dtype, is_compiling
from .image_sizes import get_image_windows, stage_valid_sizes
from .layouts import WindowLayout, build_window_layout, get_window_layout, register_cache
from .attention import KERNELS
from .regions import SAVE_MATMULS
from .windows import output_size

#: The backbone's ``attention`` argument (``'auto'`` = ``'sdpa'``).
ATTENTION_CHOICES = ("auto", "sdpa")
#: Values that were accepted once, and where the reason they went is written down.
REMOVED_ATTENTION = {"triton": "the fused Triton kernel was removed (docs/performance.md, \"The fused Triton kernel, "
                               "removed\"): use 'auto' or 'sdpa'"}

ENV_VAR = "SWIN_BACKBONE_ATTENTION"  #: overrides every backbone's ``attention`` argument


@dataclass(frozen=True)
class Switches:
    """What :func:`plan_forward` may use (an ablation turns each off: False, 0)."""

    sdpa: bool = True  #: fused SDPA kernels (else matmul + softmax)
    recompute_attention: bool = True  #: CPU training: hand-written attention backward (else autograd)
    #: training: selective activation checkpointing (qkv projection, MLP branch). None: on the CPU
    #: only, where it was measured to pay; on CUDA it doubles a step's time (docs/performance.md).
    save_memory: Optional[bool] = None
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
        name, value = ENV_VAR, env
    if not isinstance(value, str) or value not in ATTENTION_CHOICES:
        removed = f"; {REMOVED_ATTENTION[value]}" if isinstance(value, str) and value in REMOVED_ATTENTION else ""
        raise ValueError(f"{name}: expected one of {ATTENTION_CHOICES}, got {value!r}{removed}")
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
    stochastic: bool  #: any dropout or stochastic depth is active (training mode, rate > 0)
    attn_dropout: bool  #: attention dropout is active
    attention: str  #: the kernel: a key of :data:`~.attention.KERNELS`
    #: training with plain modules: selective checkpointing (:func:`~.regions.checkpointed`, ``mlp_residual``)
    save_memory: bool
    chunk_bytes: int  #: CPU row-chunk size in bytes, 0 for whole tensors
    #: :func:`plain_modules`: no hook, adapter or wrapper holds a module's output, so it may be
    #: written into (residual adds, in-place normalising or zeroing; sites add ``not grad`` where
    #: autograd may need the values), and modules may run more than once (checkpointing, chunks)
    may_write_module_outputs: bool = False
    #: CPU inference with plain modules: row-wise modules run ``chunk_bytes`` of rows at a time
    chunked: bool = False
    mode: str = "auto"  #: the ``attention`` argument in force (:data:`ATTENTION_CHOICES`)
    #: per image, its ``(h, w)`` on this plan's map (pixels / tokens); ``None``: all fill it
    valid_sizes: Optional[Tuple[Tuple[int, int], ...]] = None
    #: the forward's plan only: ``valid_sizes`` of each stage's map, ``None`` where all fill it
    stage_valid_sizes: Optional[Tuple[Optional[Tuple[Tuple[int, int], ...]], ...]] = None

    def for_stage(self, x: torch.Tensor, stage: nn.Module, index: int = 0) -> "Plan":
        """The plan for stage ``index`` on its input ``x``: frozen stages (no parameter, nor ``x``,
        requiring grad) run like inference, dropout as the stage's modules have it; its valid sizes."""
        plan = self
        if not self.tracing:
            grad = self.grad and (x.requires_grad or any(p.requires_grad for p in stage.parameters()))
            stochastic, attn_dropout = active_dropout(stage)
            if (grad, stochastic, attn_dropout) != (self.grad, self.stochastic, self.attn_dropout):
                plan = _decide_cached(self.device, self.mask_dtype, grad, False, stochastic, attn_dropout, self.mode,
                                      self.may_write_module_outputs, _SWITCHES)
        valid = None if self.stage_valid_sizes is None else self.stage_valid_sizes[index]
        if valid is None and plan.valid_sizes is None and plan.stage_valid_sizes is None:
            return plan
        return dataclasses.replace(plan, valid_sizes=valid, stage_valid_sizes=None)

    def with_valid_sizes(self, valid_sizes: Optional[Tuple[Tuple[int, int], ...]], x: torch.Tensor,
                         model: nn.Module) -> "Plan":
        """This forward's plan for images of per-image ``(h, w)`` ``valid_sizes`` in pixels
        (``None``: all fill it) at the top left of ``model``'s input ``x`` (``model`` has
        ``patch_size`` and ``stages``); the sizes of each stage's map follow."""
        if valid_sizes is None:
            return self
        if self.tracing:
            raise ValueError("valid_sizes: expected None while tracing (torch.compile / torch.export / "
                             "torch.jit.trace); per-image valid sizes run eagerly")
        maps = output_size(x.shape[-2], x.shape[-1], model.patch_size, len(model.stages))
        per_stage = stage_valid_sizes(valid_sizes, model.patch_size, len(model.stages))
        return dataclasses.replace(self, valid_sizes=valid_sizes, stage_valid_sizes=tuple(
            None if all(v == m for v in sizes) else sizes for m, sizes in zip(maps, per_stage)))


def tracing() -> bool:
    """Whether a tracer records this forward (dynamo or TorchScript)."""
    return is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting()


def active_dropout(model: nn.Module) -> Tuple[bool, bool]:
    """``(stochastic, attention dropout)``: whether any module of ``model`` in training mode has a
    dropout or stochastic-depth rate > 0, and whether one of them is attention dropout."""
    stochastic = attn = False
    for m in model.modules():
        if m.training:
            attn = attn or getattr(m, "attn_drop_rate", 0.0) > 0
            stochastic = stochastic or (isinstance(m, nn.Dropout) and m.p > 0) or getattr(m, "drop_prob", 0.0) > 0
    return stochastic or attn, attn


def plan_forward(x: torch.Tensor, model: nn.Module, *, attention: str = "auto") -> Plan:
    """Decide how ``model`` (the backbone, or any of its modules called on its own) computes its
    forward on ``x``: device, autocast dtype, grad mode, tracing, dropout and :func:`plain_modules`;
    ``attention``: the backbone's argument in force (:func:`resolve_attention`)."""
    device, dtype = x.device.type, compute_dtype(x)
    stochastic, attn_dropout = active_dropout(model)
    if tracing():
        plan = _decide(device, dtype, torch.is_grad_enabled(), True, stochastic, attn_dropout, attention, False,
                       _SWITCHES)
    else:
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in model.parameters()))
        plan = _decide_cached(device, dtype, grad, False, stochastic, attn_dropout, attention, plain_modules(model),
                              _SWITCHES)
    return plan


def _decide(device: str, mask_dtype: torch.dtype, grad: bool, tracing: bool, stochastic: bool, attn_dropout: bool,
            mode: str, plain: bool, s: Switches) -> Plan:
    """:func:`plan_forward`'s decision from the situation alone."""
    cpu = device == "cpu"
    if tracing:
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
    chunk_bytes = (cpu_chunk_bytes() if s.chunk_bytes is None else s.chunk_bytes) if eager and cpu else 0
    plain = plain and eager
    # Checkpointing and row chunks call modules more than once: exact only for plain modules.
    return Plan(
        device=device, mask_dtype=mask_dtype, align_masks=device == "cuda" if s.align_masks is None else s.align_masks,
        grad=grad, tracing=tracing, stochastic=stochastic, attn_dropout=attn_dropout, attention=attention,
        save_memory=plain and grad and (cpu if s.save_memory is None else s.save_memory) and SAVE_MATMULS is not None,
        chunk_bytes=chunk_bytes,
        may_write_module_outputs=plain, chunked=plain and chunk_bytes > 0 and not grad and not stochastic, mode=mode,
    )


_decide_cached = register_cache(lru_cache(maxsize=64)(_decide))  # (the switches are part of the key)


def plan_for(x: torch.Tensor, grad: Optional[bool] = None, attention: Optional[str] = None, **fields) -> Plan:
    """A plan for ``x`` with some fields forced (tests and direct use of the ops); the modules
    count as not plain (no shortcut re-runs them or writes into their outputs) unless ``fields``
    say otherwise (``may_write_module_outputs``, ``save_memory``, ``chunked``)."""
    grad = torch.is_grad_enabled() and x.requires_grad if grad is None else grad
    plan = _decide_cached(x.device.type, x.dtype, grad, False, False, False, "auto", False, _SWITCHES)
    if attention is not None:
        if attention not in KERNELS:
            raise ValueError(f"attention: expected one of {tuple(KERNELS)}, got {attention!r}")
        fields["attention"] = attention
    return dataclasses.replace(plan, **fields)


# ------------------------------------------------------------------------------ a stage's plan
def plan_stage(
    plan: Plan, *, height: int, width: int, window: int, shift: int, table_window: int, mask_padding: bool,
    num_heads: int, head_dim: int, device: torch.device, with_cp: bool = False,
) -> Tuple[Plan, WindowLayout, Optional[WindowLayout]]:
    """``(plan, regular, shifted)``: a stage's cached window layouts (``shifted`` ``None`` without
    a shift) and its plan: without selective checkpointing under ``with_cp`` (the whole block is
    checkpointed)."""
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
    return plan, regular, shifted
