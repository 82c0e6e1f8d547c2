"""What mmengine Runner checkpoints need from weights-only loading (torch 2.0 - 2.14, mmengine 0.10).

torch >= 2.6 defaults ``torch.load`` to ``weights_only=True`` and mmengine 0.10.7 calls it without
the argument, so every Runner checkpoint (message hub, optimizer, schedulers, numpy values) fails
there in mmdet's and mmseg's own tools. :func:`allow_mmengine_checkpoints` (run by
``import swin_backbone``) lets them load weights-only, process-wide, with data classes and one
restricted stand-in, never ``weights_only=False`` (docs/checkpoints.md, "Security model").

What a Runner checkpoint holds (``pickletools`` on what mmengine 0.10.7's Runner saves):

================================================ ===========================================================
``collections.OrderedDict`` / ``Counter``        state dicts; ``MultiStepLR``'s milestones (torch allows both)
``_codecs.encode``                               how protocol 2 pickles ``bytes`` (torch allows it)
``numpy`` ``ndarray`` / ``dtype`` / ``_reconstruct`` / ``scalar``, dtype classes
                                                 ``HistoryBuffer``'s histories, numpy scalars in ``meta``
``mmengine...HistoryBuffer``                     the message hub's logged scalars
``builtins.getattr``                             ``getattr(HistoryBuffer, 'min')``: protocol 2 writes
                                                 ``HistoryBuffer.min`` / ``max`` / ``current`` / ``mean``
                                                 (its ``_statistics_methods``) so; served by
                                                 :func:`restricted_getattr`, nothing else
================================================ ===========================================================

Plus ``MessageHub`` (older mmengine saved the hub itself), ``ConfigDict`` (configs in ``meta``) and
``defaultdict``: data classes, whose unpickling sets attributes and items and calls nothing else.
"""
from __future__ import annotations

import collections
import functools
import pickle
from typing import Any, List

#: What a pickled ``builtins.getattr`` may resolve: these attributes of these classes, nothing else.
#: mmengine's ``HistoryBuffer`` statistics methods (protocol 2 writes ``HistoryBuffer.min`` as
#: ``getattr(HistoryBuffer, 'min')``; a statistic registered with ``register_statistics`` is a
#: module function, pickled by its own name: refused, like any other code), and the nested data
#: class ``ShardedTensor.ProcessGroupState`` of FSDP's ``'local'`` shards (``ShardedTensor``
#: itself is allowed only inside the strategy's own shard loads, so elsewhere a file cannot name it).
GETATTR_ALLOWED = {
    "mmengine.logging.history_buffer.HistoryBuffer": ("min", "max", "current", "mean"),
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor": ("ProcessGroupState",),
}


class CodeInCheckpointError(pickle.UnpicklingError):
    """A pickle asked for an object that is code (``getattr`` beyond :data:`GETATTR_ALLOWED`)."""


def restricted_getattr(obj: Any, name: str, *default: Any) -> Any:
    """``builtins.getattr`` as checkpoints use it: the attributes :data:`GETATTR_ALLOWED` names,
    on exactly those classes, and nothing else. A ``getattr`` on anything else
    (``getattr(getattr, '__self__')`` reaches ``builtins``, then ``exec``) raises
    :class:`CodeInCheckpointError` without looking the attribute up."""
    allowed = GETATTR_ALLOWED.get(_class_name(obj), ()) if isinstance(obj, type) else ()
    if isinstance(name, str) and name in allowed and not default:
        return getattr(obj, name)
    what = "getattr" if obj is restricted_getattr else obj.__qualname__ if isinstance(obj, type) or (
        callable(obj) and hasattr(obj, "__qualname__")) else f"a {type(obj).__qualname__}"
    served = "; ".join(f"{k.rsplit('.', 1)[1]}.{'/'.join(v)}" for k, v in GETATTR_ALLOWED.items())
    raise CodeInCheckpointError(
        f"the file asks to run code: GLOBAL builtins.getattr({what}, {name!r}) (weights-only loading resolves "
        f"getattr only for {served})")


def _class_name(cls: type) -> str:
    """``module.qualname`` of ``cls``, if ``cls`` is the very class of that name (not a subclass or
    a look-alike defined elsewhere)."""
    import sys

    name = f"{cls.__module__}.{cls.__qualname__}"
    module = sys.modules.get(cls.__module__)
    return name if module is not None and getattr(module, cls.__qualname__, None) is cls else ""


def mmengine_safe_globals() -> List[Any]:
    """The allow-list entries of :func:`allow_mmengine_checkpoints` (classes and ``(object,
    "module.name")`` pairs, :func:`swin_backbone.torch_compat.add_safe_globals`)."""
    import _codecs

    import numpy as np

    # OrderedDict, Counter and _codecs.encode are on torch's own list since 2.x; not on 2.0 / 2.1's.
    entries: List[Any] = [collections.OrderedDict, collections.Counter, collections.defaultdict, _codecs.encode,
                          np.ndarray, np.dtype, (restricted_getattr, "builtins.getattr")]
    # numpy's reconstructors under both module names (numpy 2 moved numpy.core to numpy._core;
    # files written with either load with either): by name, nothing imported at load time.
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        entries += [(_reconstruct, f"{module}._reconstruct"), (scalar, f"{module}.scalar")]
    # The dtype classes of numpy >= 1.25 (numpy.dtypes.Float64DType ...), pickled for dtypes' state.
    entries += sorted({type(np.dtype(c)) for c in np.typecodes["All"] if c not in "MmV"} - {np.dtype},
                      key=lambda t: t.__qualname__)
    from mmengine.config.config import ConfigDict
    from mmengine.logging.history_buffer import HistoryBuffer
    from mmengine.logging.message_hub import MessageHub

    return entries + [HistoryBuffer, MessageHub, ConfigDict]


@functools.lru_cache(maxsize=None)
def allow_mmengine_checkpoints() -> None:
    """Let weights-only loading read mmengine Runner checkpoints, process-wide: swin_backbone's
    loads on every torch; every library's ``torch.load(weights_only=True)`` (mmengine's
    ``--resume``, ``tools/test.py``, ``init_model``) on torch >= 2.5. Run by ``import
    swin_backbone``; safe for any library's loads (module docstring, docs/checkpoints.md)."""
    from ..torch_compat import add_safe_globals

    add_safe_globals(mmengine_safe_globals())
