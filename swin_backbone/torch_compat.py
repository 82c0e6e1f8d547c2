"""What the installed torch can do: the one place that knows torch versions.

The package supports torch >= 2.0 (SDPA). Newer torch APIs are found by feature detection
here, never by comparing version strings elsewhere; each has a fallback with a documented
behaviour (``docs/compatibility.md``). The rest of the package imports these names instead of
calling the newer torch APIs directly. This module imports nothing of the package.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch

#: Oldest torch the package runs on (2.0 brought ``F.scaled_dot_product_attention``).
TORCH_FLOOR = (2, 0)

def parse_version(version: str) -> Tuple[int, int]:
    """``(major, minor)`` of a version string (``'2.1.2+cu121'`` -> ``(2, 1)``, ``'3.0'`` -> ``(3, 0)``)."""
    parts = (version.split("+")[0].split(".") + ["0"])[:2]
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in parts)
    return major, minor


def torch_version() -> Tuple[int, int]:
    """``(major, minor)`` of the installed torch."""
    return parse_version(torch.__version__)


def check_torch() -> None:
    """Raise one ``ImportError`` naming the installed torch if it is below :data:`TORCH_FLOOR`.
    Runs before anything else of torch is touched (an old torch may lack any of it)."""
    functional = getattr(getattr(torch, "nn", None), "functional", None)
    if torch_version() < TORCH_FLOOR or not hasattr(functional, "scaled_dot_product_attention"):
        raise ImportError(
            f"swin_backbone needs torch >= {'.'.join(map(str, TORCH_FLOOR))} "
            f"(torch.nn.functional.scaled_dot_product_attention); the installed torch is {torch.__version__}"
        )


check_torch()

from torch import nn  # noqa: E402  (after the floor check)
from torch.nn import functional  # noqa: E402

# ---------------------------------------------------------------------------- attention


def _sdpa_takes_scale() -> bool:
    # A builtin (no signature to inspect): one call on a 1-element tensor answers.
    t = torch.zeros(1, 1, 1, 1)
    try:
        functional.scaled_dot_product_attention(t, t, t, scale=1.0)
    except TypeError:
        return False
    return True


#: ``F.scaled_dot_product_attention(..., scale=)`` (torch >= 2.1). torch 2.0 always scales by
#: ``1/sqrt(head_dim)``: :func:`scaled_dot_product_attention` pre-scales the query there.
SDPA_HAS_SCALE = _sdpa_takes_scale()


def _sdpa_scaled_query(query, key, value, attn_mask=None, dropout_p=0.0, scale=None):
    """torch 2.0: SDPA without ``scale=``. ``q * (scale * sqrt(d))`` turns its fixed
    ``1/sqrt(d)`` into ``scale`` (equal to rounding; the gradient flows through the product)."""
    if scale is not None:
        query = query * (scale * math.sqrt(query.shape[-1]))
    return functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p)


#: ``F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, scale=)`` on every
#: supported torch: torch's own where it takes ``scale=`` (no Python frame in between), else
#: :func:`_sdpa_scaled_query`.
scaled_dot_product_attention = functional.scaled_dot_product_attention if SDPA_HAS_SCALE else _sdpa_scaled_query


# ---------------------------------------------------------------------------- tracing
_compiler = getattr(torch, "compiler", None)


def _dynamo_is_compiling() -> bool:
    """torch < 2.3: dynamo's own flag (imports dynamo on the first call)."""
    import torch._dynamo

    fn = getattr(torch._dynamo, "is_compiling", None)
    return bool(fn is not None and fn())


#: Whether ``torch.compile`` / ``torch.export`` is tracing: torch >= 2.3's
#: ``torch.compiler.is_compiling`` itself (no frame of ours in every forward), else dynamo's flag.
is_compiling: Callable[[], bool] = getattr(_compiler, "is_compiling", None) or _dynamo_is_compiling


def run_eagerly(fn: Callable) -> Callable:
    """``fn`` as ``torch.compile`` runs it: eagerly, the graph broken before it
    (``torch.compiler.disable``; torch 2.0: dynamo's own)."""
    disable = getattr(_compiler, "disable", None)
    if disable is None:
        import torch._dynamo

        disable = torch._dynamo.disable
    return disable(fn)


@functools.lru_cache(maxsize=None)
def compile_unsupported_reason() -> Optional[str]:
    """``None`` where ``torch.compile`` can trace on this Python, else why not (torch 2.0 refuses
    Python 3.11, torch < 2.4 Python 3.12: ``RuntimeError`` from ``torch.compile``). Imports
    dynamo on first call (about a second), so it is asked lazily."""
    try:
        import torch._dynamo
        from torch._dynamo.eval_frame import check_if_dynamo_supported
    except Exception as err:  # pragma: no cover - a torch without dynamo
        return f"torch._dynamo does not import ({type(err).__name__}: {err})"
    try:
        check_if_dynamo_supported()
    except RuntimeError as err:
        return str(err)
    return None


def has_export() -> bool:
    """``torch.export.export`` with dynamic dimensions declared by ``torch.export.Dim`` (torch >=
    2.2; torch 2.1's prototype has neither ``Dim`` nor the ``dynamic_shapes`` argument)."""
    export = getattr(torch, "export", None)
    return callable(getattr(export, "export", None)) and hasattr(export, "Dim")


def onnx_export_has_dynamo() -> bool:
    """``torch.onnx.export(..., dynamo=True)`` (torch >= 2.5)."""
    import inspect

    return "dynamo" in inspect.signature(torch.onnx.export).parameters

# ---------------------------------------------------------------------------- autocast


def _autocast_query_takes_device() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
    except TypeError:
        return False
    return True


#: ``torch.is_autocast_enabled(device_type)`` and ``torch.get_autocast_dtype`` (torch >= 2.4); older
#: torch has one query per device. Decided once here: under ``torch.compile`` a caught ``TypeError``
#: would be a graph error.
AUTOCAST_BY_DEVICE = _autocast_query_takes_device() and hasattr(torch, "get_autocast_dtype")

#: Device types autocast keeps no state for (torch's query raises there): a forward on ``meta``
#: tensors (shapes without compute) runs in its tensors' own dtype.
NO_AUTOCAST = frozenset({"meta"})


#: ``autocast_enabled(device_type)`` / ``autocast_dtype(device_type)``: whether autocast is on for
#: ``'cuda'``, ``'cpu'``, ... and the dtype it casts to. torch's own queries where they take a device
#: type (builtins: a forward that asks runs no Python frame for it); else built from older torch's
#: per-device queries. A device type in :data:`NO_AUTOCAST` is the caller's to rule out first.
if AUTOCAST_BY_DEVICE:
    autocast_enabled = torch.is_autocast_enabled
    autocast_dtype = torch.get_autocast_dtype
else:

    def autocast_enabled(device_type: str) -> bool:
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return device_type == "cuda" and bool(torch.is_autocast_enabled())

    def autocast_dtype(device_type: str) -> torch.dtype:
        return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


# ---------------------------------------------------------------------------- TF32


def has_fp32_precision(backend: Any) -> bool:
    """Whether a ``torch.backends`` switch object (``torch.backends.cuda.matmul``,
    ``torch.backends.cudnn.conv``, ...) has the ``fp32_precision`` API (torch >= 2.9). Not
    ``hasattr``: before it, ``torch.backends.cuda.matmul`` answers unknown names with an
    ``AssertionError``."""
    try:
        getattr(backend, "fp32_precision")
    except (AttributeError, AssertionError):
        return False
    return True


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


@functools.lru_cache(maxsize=None)
def load_supports_mmap() -> bool:
    """Whether ``torch.load`` takes ``mmap=`` (torch >= 2.1)."""
    import inspect

    return "mmap" in inspect.signature(torch.load).parameters


def zip_record_names(path: str) -> list:
    """The record names of a torch zip archive as torch's own reader (miniz) lists them, without
    the archive's folder (``data.pkl``, ``data/0``, ...): what ``torch.load`` will read, and what
    it tests for a TorchScript archive (``constants.pkl``). Every supported torch has it."""
    return list(torch._C.PyTorchFileReader(path).get_all_records())


def load(f: Any, map_location: Any = None, *, pickle_module: Any = None, mmap: bool = False) -> Any:
    """``torch.load`` on every supported torch.

    ``pickle_module``: torch reads the container (zip or legacy), the storages and
    ``map_location``; the module's unpickler reads the pickle (the package's inert unpickler,
    :mod:`swin_backbone.checkpoint.unpickler`). torch refuses a ``pickle_module`` together with
    ``weights_only=True``, so this call passes ``weights_only=False``: the module is the
    restriction. Without it: torch's own weights-only unpickler with torch's own list.
    ``mmap=True`` maps a zip file where torch can (>= 2.1) and reads it otherwise (same result).
    """
    kwargs: Dict[str, Any] = dict(map_location=map_location)
    if mmap and load_supports_mmap():
        kwargs["mmap"] = True
    # torch (>= 2.4) keeps map_location in a thread-local during a load and leaves it set when the
    # unpickler raises: restored, so a refused file leaves the thread's next load as it was.
    tls = getattr(torch.serialization, "_serialization_tls", None)
    before = getattr(tls, "map_location", None)
    try:
        if pickle_module is not None:
            return torch.load(f, weights_only=False, pickle_module=pickle_module, **kwargs)
        return torch.load(f, weights_only=True, **kwargs)
    finally:
        if tls is not None:
            tls.map_location = before
