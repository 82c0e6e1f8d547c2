"""mmcv's ``_ext`` for mmcv-lite, found at the end of ``sys.meta_path`` (stdlib only).

mmcv's ops modules import the compiled extension ``mmcv._ext`` (``mmcv.utils.ext_loader``), which
mmcv-lite, the pure-Python build of mmcv, does not have. :class:`MmcvExtFinder` sits last on
``sys.meta_path`` and answers that one name, so it is asked only after every other finder found
nothing: a compiled mmcv always wins. It then loads ``swin_backbone/mmcv_lite/ext.py`` (mmcv's ops
written with torchvision and torch) by its file, without importing ``swin_backbone``: mmdet and
mmseg import ``mmcv.ops`` while they import themselves, and the package registers into their
registries only once a config (``custom_imports``) or the user imports it.

This module is top-level, and imports nothing but the standard library, because the one-line
``swin_backbone_mmcv_ext.pth`` that the wheel installs beside it runs ``install()`` at every
interpreter start (setup.py). ``import swin_backbone`` installs it too (checkouts on ``PYTHONPATH``).
At start-up it imports only ``sys``; ``importlib.util`` and the loader come when ``mmcv._ext`` is asked for.
"""
import sys

#: The module mmcv's ``ext_loader.load_ext('_ext', ...)`` imports.
EXT_NAME = "mmcv._ext"
#: The stand-in's own module name: one module object under both names.
STAND_IN = "swin_backbone.mmcv_lite.ext"


def stand_in_path():
    """``swin_backbone/mmcv_lite/ext.py`` of the ``swin_backbone`` that imports here (found, not
    imported), or ``None``."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("swin_backbone")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "mmcv_lite", "ext.py")
        if os.path.isfile(path):
            return path
    return None


def _loader(origin):
    """The loader of ``ext.py`` as ``mmcv._ext``: it reuses the module where
    ``swin_backbone.mmcv_lite.ext`` was imported first, so there is one ``NotCoveredError`` class
    and one ``OPS`` table."""
    import importlib.machinery
    import importlib.util

    class StandInLoader(importlib.machinery.SourceFileLoader):
        def create_module(self, spec):
            return sys.modules.get(STAND_IN)

        def exec_module(self, module):
            if not getattr(module, "IS_SWIN_BACKBONE_LITE", False):  # not the one swin_backbone imported already
                if importlib.util.find_spec("torchvision") is None:  # the -lite extras cannot name it: it pins torch
                    import torch

                    raise ImportError(
                        "mmcv has no compiled ops (mmcv-lite) and torchvision is not installed: swin_backbone gives "
                        "mmcv its ops from torchvision; install the torchvision built for your torch "
                        f"{torch.__version__.split('+')[0]} (https://github.com/pytorch/vision#installation), or full "
                        "mmcv with compiled ops", name=EXT_NAME)
                super().exec_module(module)
                sys.modules.setdefault(STAND_IN, module)

    return StandInLoader(EXT_NAME, origin)


class MmcvExtFinder:
    """A ``sys.meta_path`` finder for ``mmcv._ext`` alone (see the module's docstring)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != EXT_NAME:
            return None
        origin = stand_in_path()
        if origin is None:
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(EXT_NAME, origin, loader=_loader(origin))

    @classmethod
    def invalidate_caches(cls):
        pass


def install():
    """Append :class:`MmcvExtFinder` to ``sys.meta_path`` (once)."""
    if not any(getattr(f, "__name__", None) == "MmcvExtFinder" for f in sys.meta_path):
        sys.meta_path.append(MmcvExtFinder)
