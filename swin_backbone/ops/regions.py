"""How a region of the model's modules runs: in one call or by cache-sized row chunks (CPU
inference), as the plan says; which activations training keeps (:func:`lean_saves`); the output
norms' NCHW maps (:func:`output_nchw`).

The model hands its own methods here (``mlp_branch``), so that these mechanics wrap a region of
modules without an ``if`` in the model (docs/design.md).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

from .image_sizes import zero_beyond_valid
from .plan import Plan


def row_chunks(total: int, row_bytes: int, budget: int) -> List[slice]:
    """``range(total)`` in ``ceil(total * row_bytes / budget)`` slices (``budget`` 0: one; at least
    a row each, and one slice also for ``total`` 0), as even as possible (a short tail's matmuls
    run at a lower rate): each within ``budget`` bytes of ``row_bytes`` rows, or one row over it."""
    count = 1 if budget <= 0 else min(max(total, 1), max(1, -(-total * row_bytes // budget)))
    slices = []
    for i in range(count):
        slices.append(slice(i * total // count, (i + 1) * total // count))
    return slices


# ------------------------------------------------------------ activations kept for backward
#: Autograd nodes whose first output backward can rebuild from what the node itself keeps:
#: LayerNorm (from its input, mean and 1 / std) and GELU (from its input). Their outputs feed
#: linears (``qkv`` and ``fc1`` after a norm, ``fc2`` after GELU), which would keep them too.
_LAYER_NORM, _GELU = "NativeLayerNormBackward0", "GeluBackward0"

#: A dtype cast (autocast's, before a linear: on CUDA a LayerNorm computes and returns fp32 and
#: the linear keeps the bf16 copy): rebuilt as the cast of its rebuilt input.
_CAST = "ToCopyBackward0"

#: A custom autograd Function whose output is a function of its first input alone (the window
#: gather) says so by setting ``ctx.rebuild_output`` (that function): rebuilt where its input is.
REBUILD_ATTR = "rebuild_output"

#: What :func:`lean_saves` keeps in place of a rebuildable tensor: the node that made it (or its
#: base, for a view), the view's ``(size, stride, storage_offset)`` and the tensor's dtype.
_Rebuild = Tuple[torch.autograd.graph.Node, Optional[Tuple[torch.Size, Tuple[int, ...], int]], torch.dtype]


def _source(node: Optional[torch.autograd.graph.Node], depth: int = 0) -> Optional[torch.autograd.graph.Node]:
    """The LayerNorm / GELU node ``node`` rebuilds from (through at most one cast and one gather of
    its first output), or ``None`` where it is no such chain."""
    name = type(node).__name__
    if name in (_LAYER_NORM, _GELU):
        return node
    if depth < 2 and node is not None and (name == _CAST or hasattr(node, REBUILD_ATTR)):
        source, output_nr = node.next_functions[0]
        return _source(source, depth + 1) if output_nr == 0 else None
    return None


def _pack(t: torch.Tensor) -> Union[torch.Tensor, _Rebuild]:
    # The node's own output (or a view of it) as it left the op: an in-place change since would
    # have given it another node, so the node's inputs rebuild exactly what autograd would keep.
    base = t if t._base is None else t._base
    if base._base is None and base.grad_fn is not None and base.output_nr == 0:
        source = _source(base.grad_fn)
        if source is not None and source is not base.grad_fn:  # (a cast / gather of it: kept where the
            # cast moved devices, as it is rebuilt as a dtype change)
            kept = source._saved_self if type(source).__name__ == _GELU else source._saved_input
            source = source if kept.device == t.device else None
        if source is not None:
            return base.grad_fn, None if base is t else (t.size(), t.stride(), t.storage_offset()), t.dtype
    return t


def _rebuild(node: torch.autograd.graph.Node, dtype: torch.dtype) -> torch.Tensor:
    """``node``'s first output again (a cast's in ``dtype``, the dtype of what was kept)."""
    name = type(node).__name__
    if name == _GELU:
        return F.gelu(node._saved_self, approximate=node._saved_approximate)
    if name == _LAYER_NORM:  # (x - mean) / std * weight + bias, in the statistics' dtype (fp32 for half)
        x, mean, rstd = node._saved_input, node._saved_result1, node._saved_result2
        weight, bias = node._saved_weight, node._saved_bias
        out = (x.to(mean.dtype) - mean).mul_(rstd)
        if weight is not None and bias is not None:
            out = torch.addcmul(bias, out, weight)  # (one rounding, as torch's CPU kernel: the same bits)
        elif weight is not None:
            out = out.mul_(weight)
        elif bias is not None:
            out = out.add_(bias)
        return out.to(x.dtype)
    source = _rebuild(node.next_functions[0][0], dtype)
    return source.to(dtype) if name == _CAST else getattr(node, REBUILD_ATTR)(source)


def _unpack(saved: Union[torch.Tensor, _Rebuild]) -> torch.Tensor:
    if isinstance(saved, torch.Tensor):
        return saved
    node, view, dtype = saved
    out = _rebuild(node, dtype)
    return out if view is None else out.as_strided(*view)


def lean_saves(plan: Plan) -> ContextManager[None]:
    """Where :attr:`Plan.save_memory`: autograd keeps no LayerNorm or GELU output for backward.

    The linear after each (``qkv`` after a norm and the window gather, ``fc1`` after a norm,
    ``fc2`` after GELU, a merging's reduction) would keep its input, or autocast's cast of it (CUDA
    runs LayerNorm in fp32 and the linear in bf16); backward rebuilds it instead
    from what the norm's or GELU's own node keeps anyway: pointwise, no module called again, no
    matmul. The predicate is each tensor's own autograd node, so a hooked or replaced module's
    output, or a tensor changed in place, is kept as usual. Else: nothing changes."""
    if not plan.save_memory:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def drop_samples(drop_path: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 image_tokens: Optional[Tuple[int, ...]]) -> torch.Tensor:
    """``drop_path(x)`` by sample: ``(B, L, C)`` in one call (``image_tokens`` ``None``); a packed
    layout's ``(1, T, C)`` image by image (its :attr:`~.layouts.WindowLayout.image_tokens`), each
    ``(1, T_b, C)`` as it is alone, so stochastic depth drops each image's branch on its own."""
    # Per image only where it can drop: an nn.Identity or a module in eval mode returns its input.
    # (Those checks first: under torch.compile, reading image_tokens guards on the image count.)
    if isinstance(drop_path, nn.Identity) or not getattr(drop_path, "training", True) or image_tokens is None:
        return drop_path(x)
    images = x.split(image_tokens, dim=1)
    dropped = [drop_path(image) for image in images]
    return x if all(d is i for d, i in zip(dropped, images)) else torch.cat(dropped, 1)


def mlp_residual(x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor],
                 drop_path: Callable[[torch.Tensor], torch.Tensor], image_tokens: Optional[Tuple[int, ...]],
                 hidden: int, plan: Plan) -> torch.Tensor:
    """``x + drop_path(branch(x))`` for caller-owned ``(B, L, C)`` ``x``, a row-wise ``branch``
    (``hidden``: its widest width) and a per-sample ``drop_path`` (:func:`drop_samples`, by
    ``image_tokens``): by cache-sized row chunks into ``x`` with :attr:`Plan.chunked` (where its
    rows exceed one), else one call."""
    # As rows: nn.Linear returns its own 2-d result, no view of it, so the in-place add below
    # records no CopySlices (whose backward zero-fills and copies a map-sized gradient).
    rows = x.reshape(-1, x.shape[-1])
    row_bytes = hidden * x.element_size()
    if plan.chunked and rows.shape[0] * row_bytes > plan.chunk_bytes:  # (more than one chunk)
        # (chunked plans hold no active stochastic module: drop_path returns its input)
        for part in row_chunks(rows.shape[0], row_bytes, plan.chunk_bytes):
            chunk = rows[part]
            chunk.add_(drop_path(branch(chunk)))
        return x
    y = branch(rows)
    # Stochastic depth drops whole samples: drop_path sees (B, L, C), never rows.
    samples = y.view(x.shape)
    dropped = drop_samples(drop_path, samples, image_tokens)
    if dropped is samples:  # (inactive: nothing dropped, add as rows)
        return (y.add_(rows) if plan.may_write_module_outputs else rows + y).view(x.shape)
    return dropped.add_(x) if plan.may_write_module_outputs else x + dropped


def output_nchw(x: torch.Tensor, norm: nn.Module, channels_last: bool, plan: Plan) -> torch.Tensor:
    """``norm(x)`` of a ``(B, H, W, C)`` map as ``(B, C, H, W)`` (a channels-last view or
    contiguous), zeros beyond each image's valid size."""
    if channels_last:
        out, own = norm(x).permute(0, 3, 1, 2), None  # a view of the module's output
    elif plan.chunked:  # (by map rows: whole, the transposing copy's strided writes miss the cache)
        batch, height, width, channels = x.shape
        out = None
        for rows in row_chunks(height, width * channels * x.element_size(), plan.chunk_bytes // 8):
            part = norm(x[:, rows]).permute(0, 3, 1, 2)
            if out is None:  # dtype known only now (autocast)
                out = part.new_empty(batch, channels, height, width)
            out[:, :, rows] = part
        own = out
    else:
        view = norm(x).permute(0, 3, 1, 2)
        out = view.contiguous()
        own = None if out is view else out  # (a 1 x 1 map is contiguous already: no copy made)
    if plan.valid_sizes is None:
        return out
    # Zeroed in place only in memory of our own, or where module outputs may be written.
    inplace = not plan.grad and (own is not None or plan.may_write_module_outputs)
    return zero_beyond_valid(out, plan.valid_sizes, 2, inplace=inplace)
