"""mmdet and mmseg on mmcv-lite: mmcv's compiled ops from torchvision and torch.

mmdet and mmseg import ``mmcv.ops`` when their models are imported, and ``mmcv.ops`` asks the
compiled extension ``mmcv._ext`` for its functions by name. mmcv-lite (the pure-Python build of
mmcv, on PyPI for every Python and torch) has no ``_ext``, so neither library imports. Where mmcv
is installed without its compiled ops, :func:`activate` (run by ``import swin_backbone``) gives
mmcv :mod:`swin_backbone.mmcv_lite.ext` as its ``_ext``: the ops the Swin detectors and segmentors
call, written with torchvision.ops and torch (docs/mmcv-lite.md lists them), and an error naming
the op, the layer and the remedy for any other. Where the compiled ops exist it does nothing. Where
both the ``mmcv`` and ``mmcv-lite`` distributions are installed it warns once (they share files).
"""
from __future__ import annotations

import importlib.util
import sys
import warnings
from typing import List, Optional

#: The module mmcv's ``ext_loader.load_ext('_ext', ...)`` imports.
EXT_NAME = "mmcv._ext"

_state = {"checked": False}


def compiled_ops_available() -> Optional[bool]:
    """``None`` without mmcv; whether mmcv's compiled extension can be found otherwise."""
    try:
        if importlib.util.find_spec("mmcv") is None:
            return None
    except (ImportError, ValueError):
        return None
    mmcv_ext = sys.modules.get(EXT_NAME)
    if mmcv_ext is not None:
        return not getattr(mmcv_ext, "IS_SWIN_BACKBONE_LITE", False)
    try:
        return importlib.util.find_spec(EXT_NAME) is not None
    except (ImportError, ValueError):  # mmcv itself fails to import: leave it to report that
        return None


def active() -> bool:
    """Whether mmcv's ops run on :mod:`swin_backbone.mmcv_lite.ext` in this process."""
    return getattr(sys.modules.get(EXT_NAME), "IS_SWIN_BACKBONE_LITE", False)


def activate() -> bool:
    """Give mmcv-lite its ``_ext`` (once per process); returns whether the stand-in is active.

    Never replaces a compiled extension: with full mmcv installed this returns False.
    """
    if _state["checked"]:
        return active()
    _state["checked"] = True
    _warn_if_both_installed()
    if compiled_ops_available() is not False:
        return active()
    if importlib.util.find_spec("torchvision") is None:  # the -lite extras cannot pin it: it pins torch
        import torch

        warnings.warn("mmcv has no compiled ops (mmcv-lite) and torchvision is not installed, so swin_backbone "
                      "cannot give mmcv its ops and mmdet / mmseg models will not import: install the torchvision "
                      f"built for your torch {torch.__version__.split('+')[0]} "
                      "(https://github.com/pytorch/vision#installation)", UserWarning, stacklevel=3)
        return False
    import mmcv

    from . import ext

    sys.modules[EXT_NAME] = ext
    mmcv._ext = ext  # type: ignore[attr-defined]
    _log(f"swin_backbone: mmcv {mmcv.__version__} has no compiled ops (mmcv-lite): its ops run on "
         "torchvision / torch (swin_backbone.mmcv_lite; install full mmcv for any op not covered)")
    return True


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


def _log(message: str) -> None:
    """One line through mmengine's logger (stdout, as every mmengine log line): stderr is kept for
    the one-line errors of the console scripts."""
    try:
        from mmengine.logging import print_log

        print_log(message, logger="current")
    except ImportError:  # pragma: no cover - mmengine is a requirement
        print(message)
