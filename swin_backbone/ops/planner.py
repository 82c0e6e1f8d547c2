"""The one place that decides how a forward is computed (docs/design.md, "The planner").

:func:`plan_stages` returns the backbone's :class:`~.plan.Plan` per stage once per forward
(:func:`plan_for`: one for a module on its own); :func:`stage_layouts` gives a stage its
window layouts bound to its plan; :func:`override` switches optimisations off for ablations
(docs/performance.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..torch_compat import NO_AUTOCAST, autocast_dtype, autocast_enabled, is_compiling
from .attention import KERNELS
from .image_sizes import get_packed_layout, image_masked_layout
from .layouts import WindowLayout, build_window_layout, cpu_chunk_bytes, get_window_layout, register_cache, row_chunks
from .plan import Plan, Sizes

#: The backbone's ``attention`` argument (``'auto'`` = ``'sdpa'``).
ATTENTION_CHOICES = ("auto", "sdpa")

ENV_VAR = "SWIN_BACKBONE_ATTENTION"  #: overrides every backbone's ``attention`` argument


@dataclass(frozen=True)
class Switches:
    """What :func:`plan_for` may use (an ablation turns each off: False, 0)."""

    sdpa: bool = True  #: fused SDPA kernels (else matmul + softmax)
    recompute_attention: bool = True  #: CPU training: hand-written attention backward (else autograd)
    #: training: no LayerNorm / GELU output kept for backward (:data:`~.attention.LEAN_SAVES`). None:
    #: the backbone's ``save_memory`` argument, whose default is the CPU only (on CUDA they cost
    #: time per step: docs/performance.md, "GPU").
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
        raise ValueError(f"{name}: expected one of {ATTENTION_CHOICES}, got {value!r}")
    return value


def tracing() -> bool:
    """A tracer records this forward: dynamo (``torch.compile`` / ``torch.export``) or TorchScript
    (``torch.jit.trace`` / ``script``). The planner's question; :func:`plan_stages` and
    :func:`stage_layouts` write it out, so that a forward enters no function for it."""
    return is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting()


# ------------------------------------------------------------------------------ exact modules
#: torch modules the fast paths may call piece by piece: exact types (a subclass, a quantized,
#: adapted or parametrized layer may compute something else on a part of its input).
EXACT_TORCH_MODULES = (nn.Linear, nn.LayerNorm, nn.GELU, nn.Dropout, nn.Identity, nn.Conv2d, nn.ReLU, nn.ModuleList,
                       nn.Sequential)
#: The package's own module classes (registered by swin_backbone.model), exact types too.
EXACT_SWIN_MODULES: List[type] = []


class ModuleFacts(NamedTuple):
    """What the modules of a tree say (:func:`read_modules`)."""

    exact: bool  #: every module exactly one of the listed classes, holding parameters, with no forward hook
    needs_grad: bool  #: a parameter requires grad
    stochastic: bool  #: a module in training mode has a dropout or stochastic-depth rate > 0
    attn_dropout: bool  #: one of them is attention dropout


def read_modules(model: nn.Module, parts: Sequence[nn.Module] = ()) -> Tuple[ModuleFacts, List[ModuleFacts]]:
    """What the modules of ``model`` say, each module read once: :class:`ModuleFacts` of the whole
    ``model``, and of each of ``parts`` (submodules of ``model``: the backbone's stages) on its own.

    ``exact``: every submodule is exactly one of :data:`EXACT_TORCH_MODULES` / :data:`EXACT_SWIN_MODULES`,
    holding ``nn.Parameter``s
    (``functional_call`` swaps in tensors for one call), with no forward hook (nor a global one):
    the one condition for calling a module on part of its input, again in backward, or adding
    into its output in place.
    """
    hooks = nn.modules.module
    types = frozenset(EXACT_TORCH_MODULES + tuple(EXACT_SWIN_MODULES))
    facts: List[ModuleFacts] = []
    for tree in (*parts, model):  # the parts, then the rest of the model (its root exempt: called as a whole)
        seen = set(map(id, parts)) if tree is model else set()
        exact, needs_grad, stochastic, attn = True, False, False, False
        stack = [tree]  # (an explicit stack: a fraction of modules()' nested generators' time)
        while stack:
            m = stack.pop()
            if m is None or (id(m) in seen and m is not tree):
                continue
            seen.add(id(m))
            stack.extend(m._modules.values())
            own = type(m) in types
            if m.training:
                # The listed classes' rates are instance attributes: read without nn.Module.__getattr__,
                # whose miss raises and formats an AttributeError (most of a training forward's reading).
                attn_rate = m.__dict__.get("attn_drop_rate", 0.0) if own else getattr(m, "attn_drop_rate", 0.0)
                drop_rate = m.__dict__.get("drop_prob", 0.0) if own else getattr(m, "drop_prob", 0.0)
                attn = attn or attn_rate > 0
                stochastic = stochastic or (isinstance(m, nn.Dropout) and m.p > 0) or drop_rate > 0
            for p in m._parameters.values():
                if p is not None:
                    needs_grad = needs_grad or p.requires_grad
                    exact = exact and (m is model or isinstance(p, nn.Parameter))
            if m is not model:
                exact = exact and own and not m._forward_hooks and not m._forward_pre_hooks
        facts.append(ModuleFacts(exact, needs_grad, stochastic or attn, attn))
    *each, whole = facts
    exact = whole.exact and not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks)
    needs_grad, stochastic, attn = whole.needs_grad, whole.stochastic, whole.attn_dropout
    for part in each:
        exact, needs_grad = exact and part.exact, needs_grad or part.needs_grad
        stochastic, attn = stochastic or part.stochastic, attn or part.attn_dropout
    return ModuleFacts(exact, needs_grad, stochastic, attn), each


# ------------------------------------------------------------------------------ the plan
def plan_stages(x: torch.Tensor, backbone: nn.Module, compiled_blocks: bool = False) -> Tuple[Plan, ...]:
    """One :class:`Plan` per stage of ``backbone`` for its forward on ``x``, decided once per forward.

    A frozen stage (no parameter, nor its input, requiring grad) runs like inference, with
    dropout as its own modules have it; a stage checkpointed in training (``with_cp``) keeps no
    lean saves (its blocks run again in backward). ``compiled_blocks``: the blocks are compiled
    regions (``compile=True``, :mod:`swin_backbone.model.compiled`): planned here, eagerly, as a
    traceable forward (:attr:`~.plan.Plan.traceable`), which is what dynamo compiles inside a block.
    """
    stages, device, enabled, switches = backbone.stages, x.device.type, torch.is_grad_enabled(), _SWITCHES
    whole, each = read_modules(backbone, (backbone.patch_embed, *stages))
    if is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting():  # (tracing(), written out: see there)
        plan = _decide(device, enabled, True, whole.stochastic, whole.attn_dropout, False, switches, False,
                       backbone.save_memory)
        return (plan,) * len(stages)
    # Stage i computes a gradient where x or a parameter before it, or one of its own, requires one.
    pos = backbone.absolute_pos_embed
    flows = x.requires_grad or each[0].needs_grad or (pos is not None and pos.requires_grad)
    plans = []
    for stage, facts in zip(stages, each[1:]):
        flows = flows or facts.needs_grad
        grad = enabled and flows
        plans.append(_decide_cached(device, grad, compiled_blocks, facts.stochastic, facts.attn_dropout, whole.exact,
                                    switches, stage.with_cp and stage.training and grad, backbone.save_memory))
    return tuple(plans)


def _decide(device: str, grad: bool, traceable: bool, stochastic: bool, attn_dropout: bool, exact: bool, s: Switches,
            checkpointed: bool = False, save_memory: Optional[bool] = None) -> Plan:
    """The plan of a situation (``checkpointed``: the blocks run again in backward; ``save_memory``:
    the backbone's argument, which an override of the switches comes before)."""
    cpu = device == "cpu"
    if traceable:
        # TorchScript exporters and FLOP counters read matmuls; torch.compile fuses them itself. In
        # training only CUDA's SDPA (memory-efficient) gives the bias its gradient.
        attention = ("matmul" if (grad and device != "cuda") or attn_dropout or not s.sdpa or torch.jit.is_tracing()
                     else "sdpa")
    elif attn_dropout or not s.sdpa:
        attention = "matmul"
    elif grad and cpu:
        # CPU SDPA gives no bias gradient: SDPA forward with a hand-written backward instead.
        attention = "recompute" if s.recompute_attention else "matmul"
    else:
        # CUDA: memory-efficient SDPA, which takes a float bias and computes its gradient.
        attention = "sdpa"
    eager = not traceable
    chunk_bytes = (cpu_chunk_bytes() if s.chunk_bytes is None else s.chunk_bytes) if eager and cpu else 0
    # (lean_saves calls no module again: its predicate is each tensor's own autograd node)
    wanted = save_memory if s.save_memory is None else s.save_memory
    save_memory = eager and grad and not checkpointed and (cpu if wanted is None else wanted)
    return Plan(attention=attention, grad=grad, traceable=traceable, save_memory=save_memory, chunk_bytes=chunk_bytes,
                exact_modules=exact and eager and not stochastic)


_decide_cached = register_cache(lru_cache(maxsize=64)(_decide))  # (the switches are part of the key)


def plan_for(x: torch.Tensor, module: Optional[nn.Module] = None, *, grad: Optional[bool] = None,
             attention: Optional[str] = None, **fields) -> Plan:
    """How ``module`` (any module of the backbone, or a model holding one) computes its forward on
    ``x`` called on its own: device, grad mode, tracing and what its modules say (:func:`read_modules`).
    Without ``module`` (direct use of the ops, tests) the modules count as not exact: no shortcut
    re-runs them or writes into their outputs. ``grad``, ``attention`` and ``fields`` are forced."""
    traced = tracing()
    facts = read_modules(module)[0] if module is not None else ModuleFacts(False, False, False, False)
    if grad is None:
        grad = torch.is_grad_enabled() and (traced or x.requires_grad or facts.needs_grad)
    # (a traced plan is decided each time: whether TorchScript or dynamo records it is part of the answer)
    decide = _decide if traced else _decide_cached
    plan = decide(x.device.type, grad, traced, facts.stochastic, facts.attn_dropout, facts.exact, _SWITCHES, False,
                  getattr(module, "save_memory", None))
    if attention is not None:
        if attention not in KERNELS:
            raise ValueError(f"attention: expected one of {tuple(KERNELS)}, got {attention!r}")
        fields["attention"] = attention
    return dataclasses.replace(plan, **fields) if fields else plan


# ------------------------------------------------------------------------------ a stage's layouts
def stage_layouts(
    x: torch.Tensor, plan: Plan, *, window_size: int, shift_size: int, pad_small_map: bool, mask_padding: bool,
    images: Union[Sizes, torch.Tensor, None] = None, row_width: int = 0,
) -> Tuple[WindowLayout, Optional[WindowLayout]]:
    """``(regular, shifted)`` window layouts of a stage's ``(B, H, W, C)`` map ``x``, bound to its
    ``plan`` (``shifted`` ``None`` without a shift), cached by size.

    ``images``, per image on this map: ``(h, w)`` tokens (:data:`~.plan.Sizes`: packed layouts of
    the images' own windows, :func:`~.image_sizes.packed_layout`, so padding-only windows are not
    computed), or a ``(B, H, W)`` bool map (static shapes: the whole map's windows with a mask
    per image, :func:`~.image_sizes.image_masked_layout`). ``row_width``: the widest row-wise
    activation per token (the MLP's hidden width), which sizes inference's row chunks.

    Without ``pad_small_map`` (the official classifier) a map whose smaller side is <= the
    window gets windows of that side and no shift; the bias table stays ``window_size``'s."""
    batch, height, width, _ = x.shape
    window, shift = window_size, shift_size
    if not pad_small_map and min(height, width) <= window_size:
        window, shift = min(height, width), 0
    # (8-aligned mask rows on CUDA: its SDPA kernels copy misaligned ones on every call)
    align = x.device.type == "cuda" if _SWITCHES.align_masks is None else _SWITCHES.align_masks
    # The masks in the dtype the blocks compute in: autocast's where it is on, else the map's.
    device, dtype = x.device, x.dtype
    if device.type not in NO_AUTOCAST and autocast_enabled(device.type):
        dtype = autocast_dtype(device.type)
    packed = images is not None and not isinstance(images, torch.Tensor)
    rows = sum(map(math.prod, images)) if packed else batch * height * width
    row_bytes = row_width * x.element_size()
    chunks = None
    if plan.exact_modules and not plan.grad and 0 < plan.chunk_bytes < rows * row_bytes:  # (inference: more than one)
        chunks = row_chunks(rows, row_bytes, plan.chunk_bytes)
    layouts = []
    for offset in (0, shift) if shift > 0 else (0,):
        if packed:
            layout = get_packed_layout(height, width, window, offset, images, device, dtype, align, window_size,
                                       plan.traceable)
        else:
            args = (height, width, window, offset, mask_padding, device, dtype, align, plan.traceable, window_size)
            # (A traced forward's sizes may be symbolic: built each time. The compiled blocks' planner
            # runs eagerly with ints: their traceable layouts are cached as eager ones are.)
            layout = build_window_layout(*args) if is_compiling() or torch.jit.is_tracing() else get_window_layout(*args)
            if images is not None:
                layout = image_masked_layout(layout, images.reshape(batch, height * width))
        layouts.append(dataclasses.replace(layout, plan=plan, row_chunks=chunks))
    return layouts[0], layouts[1] if shift > 0 else None
