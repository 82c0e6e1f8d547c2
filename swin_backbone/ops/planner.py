"""The one place that decides how a forward is computed (docs/design.md, "The planner").

:func:`plan_forward` returns a :class:`~.plan.Plan` once per forward (with one per stage for the
backbone); :func:`plan_stage` adds a stage's window layouts; :func:`override` switches
optimisations off for ablations (docs/performance.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..torch_compat import compute_dtype, is_compiling
from .image_sizes import get_packed_layout, stage_valid_sizes
from .layouts import WindowLayout, build_window_layout, get_window_layout, register_cache
from .attention import KERNELS
from .plan import Plan, Sizes
from .windows import output_size

#: The backbone's ``attention`` argument (``'auto'`` = ``'sdpa'``).
ATTENTION_CHOICES = ("auto", "sdpa")

ENV_VAR = "SWIN_BACKBONE_ATTENTION"  #: overrides every backbone's ``attention`` argument


@dataclass(frozen=True)
class Switches:
    """What :func:`plan_forward` may use (an ablation turns each off: False, 0)."""

    sdpa: bool = True  #: fused SDPA kernels (else matmul + softmax)
    recompute_attention: bool = True  #: CPU training: hand-written attention backward (else autograd)
    #: training: no LayerNorm / GELU output kept for backward (:func:`~.regions.lean_saves`). None:
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


#: What the modules of a tree say: ``(plain, needs_grad, stochastic, attention dropout)``.
Facts = Tuple[bool, bool, bool, bool]


def read_modules(model: nn.Module, parts: Sequence[nn.Module] = ()) -> Tuple[Facts, List[Facts]]:
    """What the modules of ``model`` say, each module read once: :data:`Facts` of the whole
    ``model``, and of each of ``parts`` (submodules of ``model``: the backbone's stages) on its own.

    ``plain``: every submodule is exactly a plain class holding ``nn.Parameter``s
    (``functional_call`` swaps in tensors for one call), with no forward hook (nor a global one):
    the one condition for calling a module on part of its input, again in backward, or adding
    into its output in place. ``needs_grad``: a parameter requires grad. ``stochastic``: a module
    in training mode has a dropout or stochastic-depth rate > 0; ``attention dropout``: one of
    them is attention dropout.
    """
    hooks = nn.modules.module
    types = frozenset(PLAIN_TORCH_MODULES + tuple(PLAIN_SWIN_MODULES))
    facts: List[Facts] = []
    for tree in (*parts, model):  # the parts, then the rest of the model (its root exempt: called as a whole)
        seen = set(map(id, parts)) if tree is model else set()
        plain, needs_grad, stochastic, attn = True, False, False, False
        stack = [tree]  # (an explicit stack: a fraction of modules()' nested generators' time)
        while stack:
            m = stack.pop()
            if m is None or (id(m) in seen and m is not tree):
                continue
            seen.add(id(m))
            stack.extend(m._modules.values())
            own = type(m) in types
            if m.training:
                # The plain classes' rates are instance attributes: read without nn.Module.__getattr__,
                # whose miss raises and formats an AttributeError (most of a training forward's reading).
                attn_rate = m.__dict__.get("attn_drop_rate", 0.0) if own else getattr(m, "attn_drop_rate", 0.0)
                drop_rate = m.__dict__.get("drop_prob", 0.0) if own else getattr(m, "drop_prob", 0.0)
                attn = attn or attn_rate > 0
                stochastic = stochastic or (isinstance(m, nn.Dropout) and m.p > 0) or drop_rate > 0
            for p in m._parameters.values():
                if p is not None:
                    needs_grad = needs_grad or p.requires_grad
                    plain = plain and (m is model or isinstance(p, nn.Parameter))
            if m is not model:
                plain = plain and own and not m._forward_hooks and not m._forward_pre_hooks
        facts.append((plain, needs_grad, stochastic or attn, attn))
    *each, (plain, needs_grad, stochastic, attn) = facts
    plain = plain and not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks)
    for part_plain, part_grad, part_stochastic, part_attn in each:
        plain, needs_grad = plain and part_plain, needs_grad or part_grad
        stochastic, attn = stochastic or part_stochastic, attn or part_attn
    return (plain, needs_grad, stochastic, attn), each


# ------------------------------------------------------------------------------ the plan
def plan_forward(x: torch.Tensor, model: nn.Module, valid_sizes: Optional[Sizes] = None,
                 compiled_blocks: bool = False) -> Plan:
    """Decide how ``model`` computes its forward on ``x``: device, autocast dtype, grad mode,
    tracing and what the modules say (:func:`read_modules`), once per forward.

    ``compiled_blocks``: the backbone's blocks are compiled regions (``compile=True``,
    :mod:`swin_backbone.model.compiled`): the plan is decided here, eagerly, but the stages' plans
    are those of a traced forward (plain torch ops, no row chunks, no module-output writes, no
    lean saves), which is what dynamo compiles inside a block.

    ``model`` is the backbone (it has ``stages``; ``patch_embed``, ``absolute_pos_embed`` and
    ``patch_size``), or any of its modules called on its own. For the backbone the plan holds one
    plan per stage (:attr:`Plan.stages`): a frozen stage (no parameter, nor its input, requiring
    grad) runs like inference, with dropout as its own modules have it, and ``valid_sizes``
    (per image, the ``(h, w)`` in input pixels at the top left of ``x``; ``None``: all fill it)
    become each stage's sizes (``None`` where all fill that map).
    """
    device, dtype, enabled = x.device.type, compute_dtype(x), torch.is_grad_enabled()
    stages = getattr(model, "stages", None)
    parts = () if stages is None else (model.patch_embed, *stages)
    (plain, needs_grad, stochastic, attn_dropout), part_facts = read_modules(model, parts)
    switches = _SWITCHES
    preference = getattr(model, "save_memory", None)  # (the backbone's argument; an override comes first)
    if switches.save_memory is None and preference is not None:
        switches = dataclasses.replace(switches, save_memory=preference)
    if is_compiling() or torch.jit.is_tracing() or torch.jit.is_scripting():  # dynamo or TorchScript records it
        if valid_sizes is not None:
            raise ValueError("valid_sizes: expected None while tracing (torch.compile / torch.export / "
                             "torch.jit.trace); per-image valid sizes run eagerly")
        plan = _decide(device, dtype, enabled, True, stochastic, attn_dropout, False, switches)
        return plan if stages is None else dataclasses.replace(plan, stages=(plan,) * len(stages))
    grad = enabled and (x.requires_grad or needs_grad)
    plan = _decide_cached(device, dtype, grad, False, stochastic, attn_dropout, plain, switches)
    if stages is None:
        return plan
    # Stage i computes a gradient where x or a parameter before it, or one of its own, requires one.
    pos = model.absolute_pos_embed
    flows = x.requires_grad or part_facts[0][1] or (pos is not None and pos.requires_grad)
    sizes = maps = None
    if valid_sizes is not None:
        sizes = stage_valid_sizes(valid_sizes, model.patch_size, len(stages))
        maps = output_size(x.shape[-2], x.shape[-1], model.patch_size, len(stages))
    per_stage = []
    for i, (_, stage_grad, stage_stochastic, stage_attn_dropout) in enumerate(part_facts[1:]):
        flows = flows or stage_grad
        stage_plan = _decide_cached(device, dtype, enabled and flows, compiled_blocks, stage_stochastic,
                                    stage_attn_dropout, plain, switches)
        if sizes is not None and any(v != maps[i] for v in sizes[i]):
            stage_plan = dataclasses.replace(stage_plan, valid_sizes=sizes[i])
        per_stage.append(stage_plan)
    return dataclasses.replace(plan, valid_sizes=valid_sizes, stages=tuple(per_stage))


def _decide(device: str, mask_dtype: torch.dtype, grad: bool, tracing: bool, stochastic: bool, attn_dropout: bool,
            plain: bool, s: Switches) -> Plan:
    """:func:`plan_forward`'s decision from the situation alone."""
    cpu = device == "cpu"
    if tracing:
        # TorchScript exporters and FLOP counters read matmuls; torch.compile fuses them itself. In
        # training only CUDA's SDPA (memory-efficient) gives the bias its gradient.
        attention = ("plain" if (grad and device != "cuda") or attn_dropout or not s.sdpa or torch.jit.is_tracing()
                     else "sdpa")
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
    # Row chunks call modules more than once: exact only for plain modules. (lean_saves calls
    # none again: its predicate is each tensor's own autograd node.)
    return Plan(
        device=device, mask_dtype=mask_dtype, align_masks=device == "cuda" if s.align_masks is None else s.align_masks,
        grad=grad, tracing=tracing, attn_dropout=attn_dropout, attention=attention,
        save_memory=eager and grad and (cpu if s.save_memory is None else s.save_memory),
        chunk_bytes=chunk_bytes,
        may_write_module_outputs=plain, chunked=plain and chunk_bytes > 0 and not grad and not stochastic,
    )


_decide_cached = register_cache(lru_cache(maxsize=64)(_decide))  # (the switches are part of the key)


def plan_for(x: torch.Tensor, grad: Optional[bool] = None, attention: Optional[str] = None, **fields) -> Plan:
    """A plan for ``x`` with some fields forced (tests and direct use of the ops); the modules
    count as not plain (no shortcut re-runs them or writes into their outputs) unless ``fields``
    say otherwise (``may_write_module_outputs``, ``save_memory``, ``chunked``)."""
    grad = torch.is_grad_enabled() and x.requires_grad if grad is None else grad
    plan = _decide_cached(x.device.type, x.dtype, grad, False, False, False, False, _SWITCHES)
    if attention is not None:
        if attention not in KERNELS:
            raise ValueError(f"attention: expected one of {tuple(KERNELS)}, got {attention!r}")
        fields["attention"] = attention
    return dataclasses.replace(plan, **fields)


# ------------------------------------------------------------------------------ a stage's plan
def plan_stage(
    plan: Plan, *, height: int, width: int, window_size: int, shift_size: int, pad_small_map: bool,
    mask_padding: bool, device: torch.device, with_cp: bool = False,
) -> Tuple[Plan, WindowLayout, Optional[WindowLayout]]:
    """``(plan, regular, shifted)`` for a stage of ``window_size`` windows shifted by ``shift_size``
    on a ``height x width`` map: its cached window layouts (``shifted`` ``None`` without a shift;
    with the plan's per-image valid sizes, packed layouts of the images' own windows,
    :func:`~.image_sizes.packed_layout`: padding-only windows are not computed) and its plan:
    without ``save_memory`` under ``with_cp`` (the whole block is checkpointed).

    Without ``pad_small_map`` (the official classifier) a map whose smaller side is <= the
    window gets windows of that side and no shift; the bias table stays ``window_size``'s."""
    window, shift = window_size, shift_size
    if not pad_small_map and min(height, width) <= window_size:
        window, shift = min(height, width), 0
    layouts = []
    for offset in (0, shift) if shift > 0 else (0,):
        if plan.valid_sizes is not None:  # (never while tracing: plan_forward refuses sizes then)
            layout = get_packed_layout(height, width, window, offset, plan.valid_sizes, device, plan.mask_dtype,
                                       plan.align_masks, window_size, plan.tracing)
        else:
            args = (height, width, window, offset, mask_padding, device, plan.mask_dtype, plan.align_masks,
                    plan.tracing, window_size)
            # (A traced forward's sizes may be symbolic: built each time. The compiled blocks' planner
            # runs eagerly with ints: their traced-form layouts are cached as eager ones are.)
            traced_now = is_compiling() or torch.jit.is_tracing()
            layout = build_window_layout(*args) if traced_now else get_window_layout(*args)
        layouts.append(layout)
    if with_cp and plan.save_memory:
        plan = dataclasses.replace(plan, save_memory=False)
    return plan, layouts[0], layouts[1] if shift > 0 else None
