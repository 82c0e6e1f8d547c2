"""The one place that decides how a forward is computed.

:func:`plan_forward` looks at the situation once per forward (device, autocast dtype, grad
mode, tracing, dropout) and returns a :class:`Plan`: which window-attention kernel runs,
whether the memory-saving autograd functions replace autograd's own graph, whether CPU work
runs in cache-sized row chunks, and the per-layout choices derived from those (masked-window
strategy, qkv projection before or after the window partition). The model modules pass the
plan to the functions of :mod:`swin_backbone.ops` and never ask about devices or grad modes
themselves; ``ops`` routes each call to the implementation the plan names.

Every optimisation can be switched off for an ablation (``tools/benchmark.py --ablate``) with
:func:`override`; the measured effect of each is in ``docs/performance.md``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Optional, Tuple

import torch
from torch import nn

from ..torch_compat import compute_dtype, is_compiling, is_exporting
from .layouts import register_cache

#: Window-attention implementations (see :mod:`swin_backbone.ops.attention`). A forward's plan
#: may also say ``"auto"``: each stage's kernel is then chosen by measurement
#: (:func:`swin_backbone.ops.plan_stage`, :mod:`swin_backbone.ops.kernel_choice`).
ATTENTION_KERNELS = ("sdpa", "plain", "recompute", "triton")


#: Largest share of masked windows for which the shared-bias-then-fixup strategy is used.
FIXUP_SHARE = 0.25


@dataclass(frozen=True)
class Switches:
    """What :func:`plan_forward` may use; an ablation turns each optimisation off in turn
    (booleans False, sizes 0, the project-first threshold ``inf``)."""

    sdpa: bool = True  #: fused SDPA kernels (else matmul + softmax)
    recompute_attention: bool = True  #: CPU training: hand-written attention backward (else autograd)
    save_memory: bool = True  #: LayerNorm -> linear / MLP functions that keep only their inputs
    triton: bool = True  #: CUDA: the fused Triton window-attention kernel where it applies
    chunk_bytes: Optional[int] = None  #: CPU row chunks (None: :func:`cpu_chunk_bytes`; 0: whole tensors)
    fixup_share: float = FIXUP_SHARE  #: up to this share of masked windows: shared bias, then redo them
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


def cpu_chunk_bytes() -> int:
    """Bytes of a CPU row chunk: twice the L2 cache of the cores torch uses, within 4-16 MiB.

    The L2 size is read from the OS at run time; the L3 size is not used (virtual machines
    report the whole host's L3, far more than one guest's share).
    """
    try:
        l2 = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError):
        l2 = 0
    l2 = l2 if l2 > 0 else 2**20
    return int(min(16 * 2**20, max(4 * 2**20, 2 * l2 * torch.get_num_threads())))


@dataclass(frozen=True)
class Plan:
    """How one forward (or one stage of it) is computed (the situations: docs/design.md, "The planner")."""

    device: str  #: ``'cpu'``, ``'cuda'``, ...
    mask_dtype: torch.dtype  #: dtype of cached masks: the compute dtype (the autocast dtype under autocast)
    #: masks and biases handed to SDPA have 8-aligned rows (CUDA kernels copy misaligned ones on every call)
    align_masks: bool
    grad: bool  #: autograd records this forward (some input or parameter requires grad)
    #: ``torch.compile`` / ``torch.export`` is tracing: plain ops only (and on CUDA, under
    #: ``torch.compile``, the fused Triton kernel as a custom operator)
    tracing: bool
    dropout: bool  #: dropout after the position embedding, projection and MLP is active
    stochastic: bool  #: any dropout or stochastic depth is active (training mode, rate > 0)
    attn_dropout: bool  #: attention dropout is active
    #: one of :data:`ATTENTION_KERNELS`; in a forward's plan also ``"auto"`` (CUDA: measured per
    #: stage). A stage's plan (:func:`swin_backbone.ops.plan_stage`) always names the kernel.
    attention: str
    save_memory: bool  #: norm -> qkv and norm -> MLP use the input-keeping autograd functions
    chunk_bytes: int  #: CPU row-chunk size in bytes, 0 for whole tensors
    #: up to this share of masked windows, attention runs every window with the shared bias and
    #: redoes the masked ones (above it, one per-window bias)
    fixup_share: float
    #: the backbone's ``attention`` setting (``'auto'``, ``'sdpa'``, ``'triton'``) after the
    #: ``SWIN_BACKBONE_ATTENTION`` override
    attention_mode: str = "auto"
    #: per image, the ``(h, w)`` that is the image on this plan's map (input pixels for the
    #: forward's plan, tokens for a stage's); ``None``: every image fills the map
    valid_sizes: Optional[Tuple[Tuple[int, int], ...]] = None
    #: the forward's plan only: ``valid_sizes`` of each stage's map, ``None`` where all fill it
    stage_valid_sizes: Optional[Tuple[Optional[Tuple[Tuple[int, int], ...]], ...]] = None
    triton_warps: int = 0  #: a stage's plan: Triton ``num_warps`` of the chosen launch (0: the kernel's default)
    #: a stage's plan: the signature whose measured choice this is (``None`` if not measured)
    attention_signature: Optional[object] = None

    def for_stage(self, x: torch.Tensor, stage: nn.Module, index: int = 0) -> "Plan":
        """The plan for stage ``index``: the no-grad variant when nothing in it needs a
        gradient (frozen stages run like inference), with the stage's valid sizes."""
        plan = self
        input_frozen = self.grad and not self.tracing and not x.requires_grad
        if input_frozen and not any(p.requires_grad for p in stage.parameters()):
            plan = decide(self.device, self.mask_dtype, False, False, self.dropout, self.stochastic, self.attn_dropout,
                          self.attention_mode)
        valid = None if self.stage_valid_sizes is None else self.stage_valid_sizes[index]
        if valid is None and plan.valid_sizes is None and plan.stage_valid_sizes is None:
            return plan
        return dataclasses.replace(plan, valid_sizes=valid, stage_valid_sizes=None)

    def fixup_masked(self, num_masked: int, num_windows: int) -> bool:
        """Whether attention computes all windows with the shared bias and redoes the masked ones."""
        return num_masked <= self.fixup_share * num_windows


def plan_forward(
    x: torch.Tensor, model: nn.Module, attn_dropout: bool, dropout: bool, drop_path: bool,
    valid_sizes: Optional[Tuple[Tuple[int, int], ...]] = None, attention: str = "auto",
) -> Plan:
    """Decide how ``model`` computes its forward on ``x`` (once per forward).

    ``x``'s device, dtype and ``requires_grad`` matter, and those of ``model``'s parameters;
    ``attn_dropout``, ``dropout``, ``drop_path``: whether each is in effect (training mode and
    a rate > 0); ``valid_sizes``: checked per-image ``(h, w)`` in input pixels (``model`` then
    needs ``patch_size`` and ``stages``); ``attention``: the checked attention mode.
    """
    stochastic = attn_dropout or dropout or drop_path
    device = x.device.type
    dtype = compute_dtype(x)
    tracing = is_compiling()
    grad = torch.is_grad_enabled()
    if tracing:
        if valid_sizes is not None:
            raise ValueError(
                "valid_sizes: expected None while tracing (torch.compile / torch.export); per-image "
                "valid sizes run eagerly"
            )
        return _decide(device, dtype, grad, True, dropout, stochastic, attn_dropout, attention, _SWITCHES)
    grad = grad and (x.requires_grad or any(p.requires_grad for p in model.parameters()))
    plan = decide(device, dtype, grad, False, dropout, stochastic, attn_dropout, attention)
    if valid_sizes is None:
        return plan
    return dataclasses.replace(plan, valid_sizes=valid_sizes, stage_valid_sizes=_stage_valid_sizes(
        tuple(x.shape[-2:]), valid_sizes, model.patch_size, len(model.stages)))


def _stage_valid_sizes(
    size: Tuple[int, int], valid_sizes: Tuple[Tuple[int, int], ...], patch_size: int, num_stages: int
) -> Tuple[Optional[Tuple[Tuple[int, int], ...]], ...]:
    """Per stage, the images' valid sizes on its map, ``None`` where all fill the map."""
    from .image_sizes import stage_valid_sizes
    from .windows import output_size

    maps = output_size(size[0], size[1], patch_size, num_stages)
    per_stage = stage_valid_sizes(valid_sizes, patch_size, num_stages)
    return tuple(None if all(v == m for v in sizes) else sizes for m, sizes in zip(maps, per_stage))


def plan_for_module(x: torch.Tensor, module: nn.Module) -> Plan:
    """The plan for calling one of the model's modules on its own (no plan handed down):
    dropout and stochastic depth are read off the module's submodules."""
    rates = [getattr(m, "p", 0.0) for m in module.modules() if type(m).__name__ in ("Dropout", "DropPath")]
    attn = any(getattr(m, "attn_drop_rate", 0.0) > 0 for m in module.modules())
    active = module.training
    return plan_forward(x, module, active and attn, active and any(r > 0 for r in rates), False,
                        attention=getattr(module, "attention_mode", "auto"))


def decide(device: str, mask_dtype: torch.dtype, grad: bool, tracing: bool, dropout: bool, stochastic: bool,
           attn_dropout: bool, attention: str = "auto") -> Plan:
    """:func:`plan_forward`'s decision from the situation alone (cached)."""
    return _decide_cached(device, mask_dtype, grad, tracing, dropout, stochastic, attn_dropout, attention, _SWITCHES)


def _decide(device: str, mask_dtype: torch.dtype, grad: bool, tracing: bool, dropout: bool, stochastic: bool,
            attn_dropout: bool, mode: str, s: Switches) -> Plan:
    cpu = device == "cpu"
    if mode == "triton" and not attn_dropout and not _exporting():
        # Forced: the fused kernel wherever it applies (checked per stage; errors say why not).
        attention = "triton"
    elif tracing and device == "cuda" and mode == "auto" and s.triton and not attn_dropout and not _exporting() \
            and _triton_ready():
        # torch.compile on CUDA: the kernel measured in eager mode before, if any, as one
        # opaque operator in the graph (ops.triton_ops); else what the branch below gives.
        attention = "auto"
    elif tracing:
        # The tracer sees plain torch ops (inductor fuses them itself); SDPA is one op too.
        # Exported programs stay plain torch (portable: ONNX, other runtimes).
        attention = "plain" if grad or attn_dropout or not s.sdpa else "sdpa"
    elif attn_dropout or not s.sdpa:
        attention = "plain"
    elif device == "cuda":
        # The fused Triton kernel or memory-efficient SDPA (which takes a float bias and
        # computes its gradient): verified and measured per stage (ops.plan_stage).
        attention = "auto" if mode == "auto" and s.triton and _triton_ready() else "sdpa"
    elif grad:
        # CPU SDPA gives no bias gradient (and falls to its slow math kernel for a mask that
        # requires grad): SDPA forward with a hand-written backward instead.
        attention = "recompute" if s.recompute_attention else "plain"
    else:
        attention = "sdpa"
    eager = not tracing
    return Plan(
        device=device, mask_dtype=mask_dtype, align_masks=device == "cuda" if s.align_masks is None else s.align_masks,
        grad=grad, tracing=tracing, dropout=dropout, stochastic=stochastic, attn_dropout=attn_dropout,
        attention=attention, attention_mode=mode, save_memory=eager and grad and s.save_memory,
        chunk_bytes=(cpu_chunk_bytes() if s.chunk_bytes is None else s.chunk_bytes) if eager and cpu else 0,
        # A CPU strategy: on GPUs the redo would add kernel launches.
        fixup_share=s.fixup_share if eager and cpu else 0.0,
    )


_decide_cached = register_cache(lru_cache(maxsize=64)(_decide))  # (the switches are part of the key)


def _exporting() -> bool:
    """Whether ``torch.export`` (or an exporter built on it) is tracing."""
    return is_exporting()


def _triton_ready() -> bool:
    """Whether the fused Triton kernel can run here (triton importable)."""
    from .triton_attention import triton

    return triton is not None and torch.version.hip is None  # measured on NVIDIA GPUs only


def plan_for(x: torch.Tensor, grad: Optional[bool] = None, attention: Optional[str] = None, **fields) -> Plan:
    """A plan for ``x`` with some fields forced (tests and direct use of the ops)."""
    grad = torch.is_grad_enabled() and x.requires_grad if grad is None else grad
    plan = decide(x.device.type, x.dtype, grad, False, False, False, False, "auto")
    if attention is not None:
        if attention not in ATTENTION_KERNELS + ("auto",):
            raise ValueError(f"attention: expected one of {ATTENTION_KERNELS + ('auto',)}, got {attention!r}")
        fields["attention"] = attention
    return dataclasses.replace(plan, **fields)
