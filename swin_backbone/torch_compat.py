"""What the installed torch can do: the one place that knows torch versions.

The package supports torch >= 2.0 (SDPA). Newer torch APIs are found by feature detection
here, never by comparing version strings elsewhere; each has a fallback with a documented
behaviour (``docs/compatibility.md``). The rest of the package imports these names instead of
calling the newer torch APIs directly. This module imports nothing of the package.
"""
from __future__ import annotations

import functools
import io
import math
import pickle
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

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
_AUTOCAST_BY_DEVICE = _autocast_query_takes_device() and hasattr(torch, "get_autocast_dtype")

#: Device types autocast keeps no state for (torch's query raises there): a forward on ``meta``
#: tensors (shapes without compute) runs in its tensors' own dtype.
_NO_AUTOCAST = frozenset({"meta"})


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``'cuda'``, ``'cpu'``, ...)."""
    if device_type in _NO_AUTOCAST:
        return False
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
    if device in _NO_AUTOCAST:
        return x.dtype
    if _AUTOCAST_BY_DEVICE:  # (torch's queries directly: this runs once per forward)
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return autocast_dtype(device) if autocast_enabled(device) else x.dtype


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



#: torch's weights-only unpickler takes allow-list entries as ``(object, "module.name")`` pairs
#: (a stand-in under the name a pickle uses) and scopes them to a block
#: (``torch.serialization.safe_globals``): torch >= 2.5. Older torch: :func:`load` reads through
#: :class:`_RestrictedUnpickler` (same rules, same list); torch's own weights-only loads there
#: see no entry of ours, and torch < 2.6 loads without ``weights_only`` by default (mmengine's
#: own loads need no list there).
HAS_SAFE_GLOBALS = hasattr(torch.serialization, "safe_globals")

#: An allow-list entry: a class or function (named by its ``__module__.__qualname__``) or an
#: ``(object, "module.name")`` pair.
SafeGlobal = Union[Any, Tuple[Any, str]]

#: Everything :func:`add_safe_globals` was given, by the name a pickle uses for it.
_SAFE_GLOBALS: Dict[str, Any] = {}


def global_name(obj: Any) -> str:
    """``module.qualname`` of a class or function: the name pickle writes for it."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _by_name(entries: Sequence[SafeGlobal]) -> Dict[str, Any]:
    return dict((e[1], e[0]) if isinstance(e, tuple) else (global_name(e), e) for e in entries)


def add_safe_globals(entries: Sequence[SafeGlobal]) -> bool:
    """Allow-list ``entries`` process-wide for weights-only loading: for :func:`load` on every
    torch, and for every ``torch.load(weights_only=True)`` of the process where torch takes
    pairs (>= 2.5); returns whether torch took them. Every library's loads read this list:
    data classes and restricted stand-ins only, never a callable that reaches other objects."""
    _SAFE_GLOBALS.update(_by_name(entries))
    if not HAS_SAFE_GLOBALS:
        return False
    torch.serialization.add_safe_globals(list(entries))
    return True


@functools.lru_cache(maxsize=None)
def load_supports_mmap() -> bool:
    """Whether ``torch.load`` takes ``mmap=`` (torch >= 2.1)."""
    import inspect

    return "mmap" in inspect.signature(torch.load).parameters


@functools.lru_cache(maxsize=None)
def _weights_only_globals() -> Dict[str, Any]:
    """What torch's own weights-only unpickler accepts (tensors, storages, parameters, dtypes,
    ``OrderedDict``, ``Counter``, ``torch.Size``), by ``module.name``, plus every torch dtype
    (torch 2.0's list lacks ``bfloat16``)."""
    from torch import _weights_only_unpickler

    allowed = dict(_weights_only_unpickler._get_allowed_globals())
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[f"torch.{name}"] = value
    return allowed


def allowed_globals(extra: Sequence[SafeGlobal] = ()) -> Dict[str, Any]:
    """Every global a weights-only load of :func:`load` accepts, by name: torch's own list, what
    :func:`add_safe_globals` (and, on torch >= 2.5, any library through torch) allowed, ``extra``."""
    allowed = dict(_weights_only_globals())
    if HAS_SAFE_GLOBALS:
        allowed.update(_by_name(torch.serialization.get_safe_globals()))
    allowed.update(_SAFE_GLOBALS)
    allowed.update(_by_name(extra))
    return allowed


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """torch's weights-only rules on torch < 2.5, over Python's pure-Python unpickler: globals
    resolve only by name from :attr:`allowed` (nothing is imported); REDUCE / NEWOBJ / INST / OBJ
    call only allowed objects; BUILD sets state only on tensors, ``OrderedDict`` and allowed
    classes; APPEND / SETITEM only into lists / dicts; extension codes are refused. Anything
    else raises ``pickle.UnpicklingError`` naming it."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    #: name -> object (set per load by :func:`_restricted_pickle`)
    allowed: Dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # Python 2 names of protocol 2 (torch.save's)
            import _compat_pickle

            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        key = f"{module}.{name}"
        if key in self.allowed:
            return self.allowed[key]
        raise pickle.UnpicklingError(f"Weights only load failed: Unsupported global: GLOBAL {key} (not on the "
                                     "weights-only allow-list)")

    def _check_callable(self, obj: Any) -> None:
        if not any(obj is v for v in self.allowed.values()):
            raise pickle.UnpicklingError(f"Weights only load failed: calling {global_name(obj)} is not allowed")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        self._check_callable(func)
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self._check_callable(cls)
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._check_callable(cls)
        self.append(cls.__new__(cls, *args, **kwargs))

    def _instantiate(self, klass: Any, args: list) -> None:  # INST / OBJ opcodes
        self._check_callable(klass)
        super()._instantiate(klass, args)

    def load_build(self) -> None:
        inst = self.stack[-2]  # (the state is on top)
        if type(inst) is torch.Tensor:  # legacy tensors: set_(storage, offset, size, stride)
            state = self.stack.pop()
            inst.set_(*state)
        elif type(inst) is torch.nn.Parameter or type(inst) is OrderedDict or any(
                type(inst) is v for v in self.allowed.values()):
            super().load_build()
        else:
            raise pickle.UnpicklingError(f"Weights only load failed: setting the state of a "
                                         f"{global_name(type(inst))} is not allowed")

    def load_append(self) -> None:
        self._check_target(list)
        super().load_append()

    def load_appends(self) -> None:
        self._check_target(list, marked=True)
        super().load_appends()

    def load_setitem(self) -> None:
        self._check_target(dict, depth=3)
        super().load_setitem()

    def load_setitems(self) -> None:
        self._check_target(dict, marked=True)
        super().load_setitems()

    def _check_target(self, kind: type, depth: int = 2, marked: bool = False) -> None:
        target = self.metastack[-1][-1] if marked and self.metastack and self.metastack[-1] else (
            None if marked else self.stack[-depth] if len(self.stack) >= depth else None)
        if not isinstance(target, kind):
            raise pickle.UnpicklingError(f"Weights only load failed: adding items to a "
                                         f"{type(target).__name__} is not allowed")

    def _refuse_extension(self) -> None:
        raise pickle.UnpicklingError("Weights only load failed: pickle extension codes (copyreg) are not allowed")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse_extension


def _restricted_pickle(allowed: Dict[str, Any]) -> type:
    """A ``pickle_module`` for ``torch.load`` whose unpickler is :class:`_RestrictedUnpickler`
    with ``allowed``."""
    unpickler = type("Unpickler", (_RestrictedUnpickler,), dict(allowed=allowed))

    def load(file: Any, **kwargs: Any) -> Any:
        return unpickler(file, **kwargs).load()

    def loads(data: bytes, **kwargs: Any) -> Any:
        return unpickler(io.BytesIO(data), **kwargs).load()

    return type("_RestrictedPickle", (), dict(Unpickler=unpickler, UnpicklingError=pickle.UnpicklingError,
                                              load=staticmethod(load), loads=staticmethod(loads)))


def load(f: Any, map_location: Any = None, *, weights_only: bool = True, mmap: bool = False,
         safe_globals: Sequence[SafeGlobal] = ()) -> Any:
    """``torch.load`` on every supported torch.

    ``weights_only=True``: only allow-listed globals are unpickled (:func:`allowed_globals`),
    and ``safe_globals`` for this load only. torch >= 2.5 does that itself (``safe_globals``
    scoped by ``torch.serialization.safe_globals``); older torch reads the file with
    :class:`_RestrictedUnpickler`, by the same rules. ``mmap=True`` maps the file where torch
    can (>= 2.1) and reads it otherwise (same result).
    """
    kwargs: Dict[str, Any] = dict(map_location=map_location)
    if mmap and load_supports_mmap():
        kwargs["mmap"] = True
    if not weights_only:
        return torch.load(f, weights_only=False, **kwargs)
    if HAS_SAFE_GLOBALS:
        scoped = [g for g in safe_globals if g not in torch.serialization.get_safe_globals()]
        with torch.serialization.safe_globals(scoped):
            return torch.load(f, weights_only=True, **kwargs)
    return torch.load(f, weights_only=False, pickle_module=_restricted_pickle(allowed_globals(safe_globals)),
                      **kwargs)
