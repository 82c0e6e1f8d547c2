"""What the planner decides: how one forward, or one stage of it, is computed
(docs/design.md, "The planner"). A leaf module: every op reads a :class:`Plan`, none makes one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

#: Per image of a batch, the ``(h, w)`` that is the image on a map (top left).
Sizes = Tuple[Tuple[int, int], ...]


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
    attn_dropout: bool  #: attention dropout is active
    attention: str  #: the kernel: a key of :data:`~.attention.KERNELS`
    #: training: norm and GELU outputs rebuilt in backward, not kept (:func:`~.regions.lean_saves`)
    save_memory: bool
    chunk_bytes: int  #: CPU row-chunk size in bytes, 0 for whole tensors
    #: no hook, adapter or wrapper holds a module's output (``plain`` of :func:`~.planner.read_modules`), so
    #: it may be written into (residual adds, in-place normalising or zeroing; sites add ``not
    #: grad`` where autograd may need the values), and modules may run more than once
    #: (checkpointing, chunks)
    may_write_module_outputs: bool = False
    #: CPU inference with plain modules and no dropout: row-wise modules run ``chunk_bytes`` of rows at a time
    chunked: bool = False
    #: per image, its ``(h, w)`` on this plan's map (the forward's: input pixels; a stage's:
    #: tokens); ``None``: every image fills it
    valid_sizes: Optional[Sizes] = None
    #: the backbone's forward plan only: one plan per stage (its grad mode, dropout and sizes)
    stages: Tuple["Plan", ...] = ()
