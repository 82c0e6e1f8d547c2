"""What the planner decides: how one forward, or one stage of it, is computed
(docs/design.md, "The planner"). A leaf module: every op reads a :class:`Plan`, none makes one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

#: Per image of a batch, the ``(h, w)`` that is the image on a map (top left), in that map's units.
Sizes = Tuple[Tuple[int, int], ...]


@dataclass(frozen=True)
class Plan:
    """How one forward (or one stage of the backbone's) is computed (docs/design.md, "The planner")."""

    #: the window-attention kernel: a key of :data:`~.attention.KERNELS`
    attention: str
    #: autograd records this forward (an input or a parameter requires grad)
    grad: bool
    #: computed in the form a tracer records (torch ops only, layouts built in the graph's form, no
    #: row chunks, module-output writes or lean saves): ``torch.compile`` / ``torch.export`` /
    #: ``torch.jit.trace`` records this forward, or its blocks are compiled regions
    traceable: bool
    #: training: no LayerNorm / GELU output kept for backward (:data:`~.attention.LEAN_SAVES`)
    save_memory: bool
    #: bytes of a CPU row chunk (0: whole tensors): attention backward's window groups, and with
    #: ``exact_modules`` and no ``grad`` (inference) the rows row-wise modules run on at a time
    chunk_bytes: int
    #: every module is exactly its declared class, unhooked, with no active dropout: a module may
    #: run on part of its input (row chunks) and its output may be written into
    exact_modules: bool
