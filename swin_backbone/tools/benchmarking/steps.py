"""One timed step of a model (an eval forward, a training forward + backward), run under planner
overrides, TF32 settings or ``torch.compile``, and the dtype tags of the rows' keys and labels."""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from swin_backbone import ops
from swin_backbone.torch_compat import has_fp32_precision


def with_switches(fn: Callable[[], None], changes: Dict[str, object]) -> Callable[[], None]:
    """``fn`` run under the planner overrides ``changes`` (see :func:`ops.override`)."""
    def run():
        with ops.override(**changes):
            fn()

    return run


def tf32_flags() -> List[Tuple[object, str, object, object]]:
    """``(namespace, attribute, on, off)`` of torch's TF32 switches for fp32 cuBLAS matmuls and
    cuDNN convolutions: ``fp32_precision`` ('tf32' / 'ieee') where torch has it (on torch >= 2.9
    reading or writing the legacy ``allow_tf32`` raises once ``fp32_precision`` was set), else
    ``allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    conv = getattr(torch.backends.cudnn, "conv", None)
    return [
        (matmul, "fp32_precision", "tf32", "ieee") if has_fp32_precision(matmul)
        else (matmul, "allow_tf32", True, False),
        (conv, "fp32_precision", "tf32", "ieee") if conv is not None and has_fp32_precision(conv)
        else (torch.backends.cudnn, "allow_tf32", True, False),
    ]


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 for fp32 matmuls and convolutions on or off (CUDA; flags only elsewhere), restored on exit."""
    flags = tf32_flags()
    saved = [getattr(ns, name) for ns, name, _, _ in flags]
    try:
        for ns, name, on, off in flags:
            setattr(ns, name, on if enabled else off)
        yield
    finally:
        for (ns, name, _, _), value in zip(flags, saved):
            setattr(ns, name, value)


def compile_model(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """``torch.compile(model, **kwargs)`` (one place, so a test can stand in for it on a CPU)."""
    return torch.compile(model, **kwargs)


def eval_step(model, x, autocast_dtype=None, **kwargs):
    """One forward of ``model(x, **kwargs)`` under inference mode (and autocast)."""
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with torch.inference_mode(), ctx:
            model(x, **kwargs)

    return run


def train_step(model, x, autocast_dtype=None, **kwargs):
    """One forward of ``model(x, **kwargs)`` (autocast), the mean of its outputs' sum, backward."""
    def run():
        ctx = torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with ctx:
            outs = model(x, **kwargs)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        loss = sum(o.float().mean() for o in outs)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def dtype_tag(dtype: Optional[torch.dtype], fp32: str = "fp32") -> str:
    """A row's dtype in its key and label: ``fp32`` (no autocast) or the autocast dtype's."""
    return fp32 if dtype is None else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
