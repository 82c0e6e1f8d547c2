"""What the installed torch can do: the one place that knows torch versions.

The package supports torch >= 2.0 (SDPA). Newer torch APIs are found by feature detection
here, never by comparing version strings elsewhere; each has a fallback with a documented
behaviour (``docs/compatibility.md``). The rest of the package imports these names instead of
calling the newer torch APIs directly. This module imports nothing of the package.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch
from torch import nn

#: Oldest torch the package runs on (2.0 brought ``F.scaled_dot_product_attention``).
TORCH_FLOOR = (2, 0)

F = TypeVar("F", bound=Callable[..., Any])


def torch_version() -> tuple:
    """``(major, minor)`` of the installed torch (``'2.1.2+cu121'`` -> ``(2, 1)``)."""
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:2])


def check_torch() -> None:
    """Raise one ``ImportError`` naming the installed torch if it is below :data:`TORCH_FLOOR`."""
    if torch_version() < TORCH_FLOOR or not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        raise ImportError(
            f"swin_backbone needs torch >= {'.'.join(map(str, TORCH_FLOOR))} "
            f"(torch.nn.functional.scaled_dot_product_attention); the installed torch is {torch.__version__}"
        )


check_torch()

# ---------------------------------------------------------------------------- tracing
_compiler = getattr(torch, "compiler", None)


def is_compiling() -> bool:
    """Whether ``torch.compile`` / ``torch.export`` is tracing (torch >= 2.3's
    ``torch.compiler.is_compiling``; before, dynamo's own flag)."""
    fn = getattr(_compiler, "is_compiling", None)
    if fn is None:
        import torch._dynamo

        fn = getattr(torch._dynamo, "is_compiling", None)
    return bool(fn is not None and fn())


def is_exporting() -> bool:
    """Whether ``torch.export`` (or an exporter built on it) is tracing (False where torch
    cannot tell: such torch exports through the same graphs as ``torch.compile``)."""
    fn = getattr(_compiler, "is_exporting", None)
    return bool(fn is not None and fn())


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result`` (torch >= 2.1), else dynamo's (2.0)."""
    decorator = getattr(_compiler, "assume_constant_result", None)
    if decorator is None:
        import torch._dynamo

        decorator = getattr(torch._dynamo, "assume_constant_result", None)
    return fn if decorator is None else decorator(fn)


#: ``torch.library.custom_op`` (torch >= 2.4): the fused Triton kernel can sit inside
#: ``torch.compile`` graphs as an opaque operator. Without it compiled graphs use plain attention.
HAS_CUSTOM_OP = hasattr(torch.library, "custom_op")

# ---------------------------------------------------------------------------- autocast


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``'cuda'``, ``'cpu'``, ...)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))  # torch >= 2.4
    except TypeError:
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        if device_type == "cuda":
            return bool(torch.is_autocast_enabled())
        return False


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype autocast casts to on ``device_type``."""
    get = getattr(torch, "get_autocast_dtype", None)  # torch >= 2.4
    if get is not None:
        return get(device_type)
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype()
    return torch.get_autocast_gpu_dtype()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``x``'s device computes in: autocast's if it is on there, else ``x``'s."""
    device = x.device.type
    return autocast_dtype(device) if autocast_enabled(device) else x.dtype


# ---------------------------------------------------------------------------- TF32


def matmul_allows_tf32() -> bool:
    """torch's fp32 CUDA matmul setting. Read through ``fp32_precision`` where torch has it
    (torch >= 2.9: reading ``allow_tf32`` raises once a program has set the newer API)."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


# ---------------------------------------------------------------------------- modules and loading


def register_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> None:
    """``module.register_load_state_dict_pre_hook(hook)``: ``hook(module, state_dict, prefix,
    local_metadata, strict, missing_keys, unexpected_keys, error_msgs)``. torch < 2.4 has the
    same hook as the private ``_register_load_state_dict_pre_hook(hook, with_module=True)``."""
    public = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        public(hook)
    else:
        module._register_load_state_dict_pre_hook(hook, with_module=True)


#: ``torch.serialization.add_safe_globals`` (torch >= 2.4): weights-only loading can be told
#: about plain-data classes. Without it ``torch.load(weights_only=True)`` still reads tensors,
#: dicts, lists and numbers (every checkpoint format's weights); torch < 2.6 loads without
#: ``weights_only`` by default, so mmengine's own loads need no allow-list there.
HAS_SAFE_GLOBALS = hasattr(torch.serialization, "add_safe_globals")


def add_safe_globals(classes: list) -> bool:
    """Allow-list ``classes`` for weights-only loading where torch can; returns whether it did."""
    if not HAS_SAFE_GLOBALS:
        return False
    torch.serialization.add_safe_globals(classes)
    return True


def load_supports_mmap() -> bool:
    """Whether ``torch.load`` takes ``mmap=`` (torch >= 2.1)."""
    import inspect

    return "mmap" in inspect.signature(torch.load).parameters


def device_capability(device: torch.device) -> Optional[tuple]:
    """``(major, minor)`` of a CUDA device, ``None`` elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))
