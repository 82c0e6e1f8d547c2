"""What the installed torch can do: the one place that knows torch versions.

The package supports torch >= 2.0 (SDPA). Newer torch APIs are found by feature detection
here, never by comparing version strings elsewhere; each has a fallback with a documented
behaviour (``docs/compatibility.md``). The rest of the package imports these names instead of
calling the newer torch APIs directly. This module imports nothing of the package.
"""
from __future__ import annotations

import functools
import io
import logging
import math
import pickle
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

#: Oldest torch the package runs on (2.0 brought ``F.scaled_dot_product_attention``).
TORCH_FLOOR = (2, 0)

F = TypeVar("F", bound=Callable[..., Any])


def torch_version() -> tuple:
    """``(major, minor)`` of the installed torch (``'2.1.2+cu121'`` -> ``(2, 1)``)."""
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:2])


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


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, scale=None):
    """``F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, scale)`` on every
    supported torch: torch's own where it takes ``scale=``, else :func:`_sdpa_scaled_query`.
    ``F.scaled_dot_product_attention`` is looked up on each call (tests record its calls)."""
    if SDPA_HAS_SCALE:
        return functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                       scale=scale)
    return _sdpa_scaled_query(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)


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


#: ``torch.is_autocast_enabled(device_type)`` (torch >= 2.4); older torch has one query per
#: device. Decided once here: under ``torch.compile`` a caught ``TypeError`` would be a graph error.
_AUTOCAST_BY_DEVICE = _autocast_query_takes_device()


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``'cuda'``, ``'cpu'``, ...)."""
    if _AUTOCAST_BY_DEVICE:
        return bool(torch.is_autocast_enabled(device_type))
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
    if has_fp32_precision(torch.backends.cuda.matmul):
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


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


#: ``torch.serialization.add_safe_globals`` (torch >= 2.4): weights-only loading can be told
#: about plain-data classes. Without it ``torch.load(weights_only=True)`` still reads tensors,
#: dicts, lists and numbers (every checkpoint format's weights), and :func:`load` reads the
#: allow-listed classes too (Runner checkpoints); torch < 2.6 loads without ``weights_only`` by
#: default, so mmengine's own loads need no allow-list there.
HAS_SAFE_GLOBALS = hasattr(torch.serialization, "add_safe_globals")

#: Everything :func:`add_safe_globals` was given (honoured by :func:`load` on every torch).
_SAFE_GLOBALS: List[Any] = []


def add_safe_globals(classes: list) -> bool:
    """Allow-list ``classes`` for weights-only loading: for :func:`load` on every torch, and for
    torch's own ``torch.load(weights_only=True)`` where torch can (>= 2.4); returns whether torch
    took them."""
    _SAFE_GLOBALS.extend(c for c in classes if not any(c is d for d in _SAFE_GLOBALS))
    if not HAS_SAFE_GLOBALS:
        return False
    torch.serialization.add_safe_globals(classes)
    return True


@functools.lru_cache(maxsize=None)
def load_supports_mmap() -> bool:
    """Whether ``torch.load`` takes ``mmap=`` (torch >= 2.1)."""
    import inspect

    return "mmap" in inspect.signature(torch.load).parameters


@functools.lru_cache(maxsize=None)
def _weights_only_globals() -> Dict[str, Any]:
    """What torch's own weights-only unpickler accepts (tensors, storages, parameters, dtypes,
    ``OrderedDict``, ``torch.Size``), by ``module.name``, plus every torch dtype (torch 2.0's list
    lacks ``bfloat16``)."""
    from torch import _weights_only_unpickler

    allowed = dict(_weights_only_unpickler._get_allowed_globals())
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[f"torch.{name}"] = value
    return allowed


def _allowed_callable(obj: Any) -> bool:
    return any(obj is v for v in _weights_only_globals().values()) or any(obj is c for c in _SAFE_GLOBALS)


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """An unpickler that resolves only allow-listed globals (torch's weights-only list and what
    :func:`add_safe_globals` added) and calls or instantiates only those, as torch's weights-only
    unpickler does (Python's pure-Python unpickler, its REDUCE / NEWOBJ opcodes checked: an
    attribute reached through an allow-listed ``getattr`` is never called). Anything else raises
    ``pickle.UnpicklingError``."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # Python 2 names of protocol 2 (torch.save's)
            import _compat_pickle

            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        allowed = _weights_only_globals()
        key = f"{module}.{name}"
        if key in allowed:
            return allowed[key]
        # An allow-listed class, possibly pickled under another module path than its own
        # (numpy.core -> numpy._core): resolved, then compared by identity. Only modules of the
        # packages the allow-list comes from are imported.
        if module.split(".")[0] in {getattr(c, "__module__", "").split(".")[0] for c in _SAFE_GLOBALS}:
            try:
                found = super().find_class(module, name)
            except Exception:
                found = None
            if found is not None and any(found is c for c in _SAFE_GLOBALS):
                return found
        raise pickle.UnpicklingError(
            f"Weights only load failed: unsupported global {key} (not on the allow-list of "
            "swin_backbone.torch_compat.load)"
        )

    def _refuse(self, obj: Any) -> None:
        raise pickle.UnpicklingError(f"Weights only load failed: calling {obj!r} is not allowed")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not _allowed_callable(func):
            self._refuse(func)
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not _allowed_callable(cls):
            self._refuse(cls)
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if not _allowed_callable(cls):
            self._refuse(cls)
        self.append(cls.__new__(cls, *args, **kwargs))

    def _instantiate(self, klass: Any, args: list) -> None:  # INST / OBJ opcodes
        if not _allowed_callable(klass):
            self._refuse(klass)
        super()._instantiate(klass, args)

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex


class _RestrictedPickle:
    """A ``pickle_module`` for ``torch.load`` whose unpickler is :class:`_RestrictedUnpickler`."""

    Unpickler = _RestrictedUnpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return _RestrictedUnpickler(file, **kwargs).load()

    @staticmethod
    def loads(data: bytes, **kwargs: Any) -> Any:
        return _RestrictedUnpickler(io.BytesIO(data), **kwargs).load()


def load(f: Any, map_location: Any = None, *, weights_only: bool = True, mmap: bool = False) -> Any:
    """``torch.load`` on every supported torch.

    ``weights_only=True``: only allow-listed globals are unpickled. torch >= 2.4 does that itself
    (with what :func:`add_safe_globals` allowed); older torch's weights-only unpickler cannot
    restore allow-listed classes (numpy arrays and scalars in a Runner checkpoint's meta), so
    there the file is read by :class:`_RestrictedUnpickler`, with the same allow-list.
    ``mmap=True`` maps the file where torch can (>= 2.1) and reads it otherwise (same result).
    """
    kwargs: Dict[str, Any] = dict(map_location=map_location)
    if mmap and load_supports_mmap():
        kwargs["mmap"] = True
    if not weights_only:
        return torch.load(f, weights_only=False, **kwargs)
    if HAS_SAFE_GLOBALS:
        return torch.load(f, weights_only=True, **kwargs)
    return torch.load(f, weights_only=False, pickle_module=_RestrictedPickle, **kwargs)


def device_capability(device: torch.device) -> Optional[tuple]:
    """``(major, minor)`` of a CUDA device, ``None`` elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


# ---------------------------------------------------------------------------- features and notes

#: Each newer-torch feature the package uses: ``name -> (test, what it needs, what happens
#: without it)``. The table of docs/compatibility.md; tests that need a feature carry
#: ``@pytest.mark.torch_feature(name)`` and skip, naming it, where it is missing.
FEATURES: Dict[str, Tuple[Callable[[], bool], str, str]] = {
    "sdpa_scale": (
        lambda: SDPA_HAS_SCALE,
        "scaled_dot_product_attention(scale=) (torch >= 2.1)",
        "the query is pre-scaled before SDPA (equal to rounding)",
    ),
    "compile": (
        lambda: compile_unsupported_reason() is None,
        "torch.compile on this Python (torch >= 2.1 on Python 3.11, >= 2.4 on 3.12)",
        "torch.compile raises in torch itself; the model runs eagerly",
    ),
    "compile_one_graph": (
        lambda: compile_unsupported_reason() is None and HAS_CUSTOM_OP,
        "torch.compile tracing a whole forward as one graph (seen on torch 2.14; torch 2.1's dynamo "
        "splits it into 80-96 graphs; versions between not tested, so torch >= 2.4 is assumed)",
        "torch.compile runs the forward as several graphs (graph breaks: slower compiled code)",
    ),
    "custom_op": (
        lambda: HAS_CUSTOM_OP,
        "torch.library.custom_op (torch >= 2.4)",
        "inside torch.compile graphs attention runs as plain SDPA instead of the fused Triton kernel "
        "(eager CUDA still uses the kernel)",
    ),
    "cpu_flash_sdpa": (
        lambda: hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
        "a flash SDPA kernel for CPU tensors (newer torch: not in 2.0 or 2.1)",
        "CPU attention runs SDPA's math kernel (same results, slower and more memory)",
    ),
    "export": (
        has_export,
        "torch.export.export with torch.export.Dim (torch >= 2.2)",
        "torch.export is missing in torch itself; TorchScript tracing / eager are unaffected",
    ),
    "onnx_dynamo": (
        onnx_export_has_dynamo,
        "torch.onnx.export(dynamo=True) (torch >= 2.5)",
        "the TorchScript-based ONNX exporter (torch.onnx.export without dynamo=True) is what remains",
    ),
    "safe_globals": (
        lambda: HAS_SAFE_GLOBALS,
        "torch.serialization.add_safe_globals (torch >= 2.4)",
        "swin_backbone loads checkpoints weights-only through its own restricted unpickler (same "
        "allow-list); mmengine's own torch.load calls are unrestricted on such torch (its default)",
    ),
    "load_mmap": (
        load_supports_mmap,
        "torch.load(mmap=True) (torch >= 2.1)",
        "files are read into memory instead of memory-mapped (same tensors)",
    ),
}


def has_feature(name: str) -> bool:
    """Whether the installed torch has feature ``name`` (a key of :data:`FEATURES`)."""
    return bool(FEATURES[name][0]())


def missing_reason(name: str) -> str:
    """One sentence: what ``name`` needs, the installed torch, and what happens instead."""
    _, needs, instead = FEATURES[name]
    return f"needs {needs}; the installed torch is {torch.__version__} (Python {sys.version.split()[0]}): {instead}"


_NOTED: set = set()


def note_missing(name: str, consequence: Optional[str] = None) -> bool:
    """Say once per process, in mmengine's current log, that feature ``name`` is missing and what
    happens instead; call it where the feature would have been used. Returns whether it logged
    (``False`` when said before). ``consequence`` overrides the table's."""
    if name in _NOTED:
        return False
    _NOTED.add(name)
    _, needs, instead = FEATURES[name] if name in FEATURES else (None, name, "")
    message = (f"swin_backbone: {needs} is not available in torch {torch.__version__}: "
               f"{consequence or instead}")
    try:
        from mmengine.logging import print_log

        print_log(message, logger="current", level=logging.WARNING)
    except ImportError:  # pragma: no cover - mmengine is a requirement
        logging.getLogger("swin_backbone").warning(message)
    return True
