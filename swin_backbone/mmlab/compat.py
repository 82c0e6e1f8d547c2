"""Compatibility shims for the pinned stack (torch 2.14 + mmengine 0.10.7)."""
from __future__ import annotations

import collections
import functools


@functools.lru_cache(maxsize=None)
def allow_mmengine_checkpoints() -> None:
    """Let ``torch.load(weights_only=True)`` read mmengine Runner checkpoints.

    torch >= 2.6 defaults to ``weights_only=True`` and mmengine 0.10.7 calls ``torch.load``
    without the argument, so checkpoints holding numpy scalars or a message hub (every
    Runner checkpoint, needed by ``--resume``) fail with ``UnpicklingError``. Allow-listing
    the plain-data classes they contain fixes that without unpickling arbitrary code
    (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` would).
    """
    import _codecs

    import numpy as np
    from ..torch_compat import add_safe_globals

    # getattr: HistoryBuffer keeps bound methods (pickled as getattr(buffer, 'min')); the
    # weights_only unpickler still refuses to *call* anything not allow-listed, so this only
    # re-creates attribute references. _codecs.encode: how protocol 2 pickles bytes.
    safe = [collections.OrderedDict, collections.defaultdict, np.ndarray, np.dtype, getattr, _codecs.encode]
    try:  # numpy >= 1.25 / 2.x
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # pragma: no cover - older numpy
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore
    safe += [_reconstruct, scalar]
    safe += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool", "uint8", "float16")]
    try:
        from mmengine.logging.history_buffer import HistoryBuffer
        from mmengine.logging.message_hub import MessageHub

        safe += [HistoryBuffer, MessageHub]
    except ImportError:  # pragma: no cover
        pass
    try:
        from mmengine.config.config import ConfigDict

        safe.append(ConfigDict)
    except ImportError:  # pragma: no cover
        pass
    add_safe_globals(safe)
