"""mmdet and mmseg on mmcv-lite: mmcv's compiled ops from torchvision and torch.

mmdet and mmseg import ``mmcv.ops`` when their models are imported, and ``mmcv.ops`` asks the
compiled extension ``mmcv._ext`` for its functions by name. mmcv-lite (the pure-Python build of
mmcv, on PyPI for every Python and torch) has no ``_ext``. Where mmcv has no compiled ops, a finder
at the end of ``sys.meta_path`` (``_swin_backbone_mmcv_ext``, installed at interpreter start by the
wheel's ``.pth`` and by :func:`activate`) gives mmcv :mod:`swin_backbone.mmcv_lite.ext` as its
``_ext`` when, and only when, mmcv asks for it, whoever imports ``mmcv.ops`` first: the ops the Swin
detectors and segmentors call (:data:`~swin_backbone.mmcv_lite.ext.OPS`, docs/mmcv-lite.md), and an
error naming the op and the remedy for any other. A compiled ``_ext`` is found before it and wins.
Where both the ``mmcv`` and ``mmcv-lite`` distributions are installed :func:`activate` warns once.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Iterator, List, Optional

import _swin_backbone_mmcv_ext as _finder

#: The module mmcv's ``ext_loader.load_ext('_ext', ...)`` imports.
EXT_NAME = _finder.EXT_NAME

_state = {"checked": False}

if getattr(sys.modules.get(EXT_NAME), "IS_SWIN_BACKBONE_LITE", False):  # mmcv loaded it first
    ext = sys.modules[EXT_NAME]
    sys.modules.setdefault(_finder.STAND_IN, ext)


def _is_stand_in(module: Optional[ModuleType]) -> bool:
    return getattr(module, "IS_SWIN_BACKBONE_LITE", False)


def compiled_ext() -> Optional[ModuleType]:
    """mmcv's compiled ``_ext``, or ``None`` (no mmcv, or mmcv without compiled ops). The one
    check: it imports ``mmcv._ext`` as mmcv does, which gives the stand-in where none is compiled."""
    try:
        if importlib.util.find_spec("mmcv") is None:
            return None
        module = importlib.import_module(EXT_NAME)
    except ImportError:
        return None
    return None if _is_stand_in(module) else module


def active() -> bool:
    """Whether mmcv's ops run on :mod:`swin_backbone.mmcv_lite.ext` in this process."""
    return _is_stand_in(sys.modules.get(EXT_NAME))


def activate() -> None:
    """Install the ``mmcv._ext`` finder (where no ``.pth`` did) and warn, once per process, where
    both mmcv distributions are installed. Loads nothing: mmcv's own import of ``mmcv._ext`` does."""
    _finder.install()
    if not _state["checked"]:
        _state["checked"] = True
        _warn_if_both_installed()


@contextlib.contextmanager
def bound_to(ext_module) -> Iterator[None]:
    """mmcv's layers and autograd Functions call ``ext_module`` inside the block (each mmcv.ops
    module binds its ``ext_module`` at import; this rebinds them and restores them after): to run
    one model on the stand-in and on compiled mmcv in one process (tests, the benchmark)."""
    import mmcv.ops  # noqa: F401  (every op module imported, so every binding is found)

    modules = [m for n, m in list(sys.modules.items()) if n.startswith("mmcv.ops.") and hasattr(m, "ext_module")]
    saved = [(m, m.ext_module) for m in modules]
    for m, _ in saved:
        m.ext_module = ext_module
    try:
        yield
    finally:
        for m, old in saved:
            m.ext_module = old


#: The two distributions that install the ``mmcv`` package (full, and pure-Python "lite").
MMCV_DISTRIBUTIONS = ("mmcv", "mmcv-lite")


def installed_mmcv_distributions() -> List[str]:
    """Which of :data:`MMCV_DISTRIBUTIONS` this environment has installed."""
    from importlib import metadata

    found = []
    for name in MMCV_DISTRIBUTIONS:
        for spelling in {name, name.replace("-", "_")}:  # older importlib.metadata does not normalise
            try:
                metadata.distribution(spelling)
            except metadata.PackageNotFoundError:
                continue
            found.append(name)
            break
    return found


def _warn_if_both_installed() -> None:
    """Both distributions write the same ``mmcv/`` files: whichever was installed last decides
    whether compiled ops exist, and uninstalling either one breaks the other."""
    if len(installed_mmcv_distributions()) == len(MMCV_DISTRIBUTIONS):
        warnings.warn("both 'mmcv' and 'mmcv-lite' are installed: they write the same mmcv/ files, so the one "
                      "installed last decides whether mmcv has compiled ops, and uninstalling either breaks the "
                      "other. Keep one: `pip uninstall -y mmcv-lite` (full mmcv) or `pip uninstall -y mmcv mmcv-lite "
                      "&& pip install mmcv-lite==2.1.0` (no compiled ops; swin_backbone gives it its ops)",
                      UserWarning, stacklevel=3)
