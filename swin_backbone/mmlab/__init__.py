"""How ``import swin_backbone`` plugs into mmengine, mmdet, mmseg and mmpretrain without importing them.

The package's classes need ``mmengine.model`` (and through it ``mmengine.optim``, which imports
transformers and peft), and its data preprocessors need mmdet's and mmseg's models: importing them
up front costs seconds. Instead :func:`plug_in` (run by ``import swin_backbone``) leaves a note in
each place that will need them, and each note is read by mmengine itself:

- the ``MODELS`` registry of each installed library (and of the ``swin_backbone`` scope,
  :mod:`swin_backbone.registry`) gets :data:`LOCATION` among its ``_locations``, the modules that
  mmengine's ``Registry.get`` imports the first time it looks a name up (``build``, ``in``,
  ``init_default_scope`` + any registry's ``build``, a Runner's model): importing
  :mod:`swin_backbone.mmlab.registry` registers ``SwinBackbone``, ``SwinV2Backbone``,
  ``SwinDetDataPreprocessor`` and ``SwinSegDataPreProcessor``, the real classes;
- the ``OPTIM_WRAPPERS`` registries (mmengine's and the libraries') get :data:`OPTIM_LOCATION`
  (``BF16AutocastOptimWrapper``);
- mmengine's ``MODULE2PACKAGE`` table gets the ``swin_backbone::`` config scope;
- mmengine's ``CheckpointLoader`` gets this package's checkpoint reader
  (:mod:`swin_backbone.checkpoint.mmengine_schemes`), and the backbones their ``load_state_dict``
  key converter (:mod:`swin_backbone.checkpoint.hooks`).

A library module imported already gets its note at once; one imported later gets it as its import
finishes (:func:`after_import`), so the import order of swin_backbone, mmengine and the libraries
does not matter. This module imports nothing but the standard library.
"""
from __future__ import annotations

import importlib
import sys
import threading
from typing import Callable, Dict, List, Sequence

#: The libraries whose ``MODELS`` registries receive the backbones (where installed).
LIBRARIES = ("mmdet", "mmseg", "mmpretrain")

#: Where each registry finds the backbones: importing it registers them (:func:`registry.register_all`).
LOCATION = "swin_backbone.mmlab.registry"

#: Where the ``OPTIM_WRAPPERS`` registries (mmengine's, and each library's) find
#: ``BF16AutocastOptimWrapper``: importing it registers it.
OPTIM_LOCATION = "swin_backbone.mmlab.optim"

#: The registry modules (``<module>.MODELS``) that get :data:`LOCATION`: the libraries' and the
#: ``swin_backbone`` scope's.
REGISTRY_MODULES = tuple(f"{lib}.registry" for lib in LIBRARIES) + ("swin_backbone.registry",)

#: The ``package::`` scope of the configs shipped in ``swin_backbone/.mim/configs``:
#: ``_base_ = 'swin_backbone::mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'``.
CONFIG_SCOPE = "swin_backbone"

#: What mmengine's ``get_installed_path`` is given for the scope. Not the distribution name
#: (``swin-backbone``): for that mmengine answers ``<site-packages>/swin_backbone``, which an
#: editable install does not have. A module path that is no distribution's name takes its
#: ``importlib`` branch instead, which answers this package's directory in wheel and editable
#: installs alike (the directory of ``swin_backbone/registry.py``).
CONFIG_PACKAGE = "swin_backbone.registry"


# ------------------------------------------------------------------ after an import
class _AfterImportLoader:
    """A module's own loader, and then the callbacks waiting for that module."""

    def __init__(self, finder: "AfterImportFinder", loader, callbacks: List[Callable]) -> None:
        self.finder = finder
        self.loader = loader
        self.callbacks = callbacks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # The module keeps its own loader (tracebacks, inspect and reloads never see this one).
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        try:
            self.loader.exec_module(module)
        except BaseException:
            self.finder.wait(module.__name__, self.callbacks)  # for the next attempt to import it
            raise
        for callback in self.callbacks:
            callback(module)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class AfterImportFinder:
    """A ``sys.meta_path`` finder that finds nothing itself: for the module names that have
    callbacks waiting, it asks the finders after it and runs the callbacks once the module has
    executed (each name once: the first import)."""

    def __init__(self) -> None:
        self.waiting: Dict[str, List[Callable]] = {}
        self._lock = threading.RLock()
        self._finding = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.waiting or fullname in self._finding:
            return None
        with self._lock:
            callbacks = self.waiting.pop(fullname, None)
            if callbacks is None:
                return None
            self._finding.add(fullname)
            try:
                spec = self._others_spec(fullname, path, target)
            finally:
                self._finding.discard(fullname)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                self.wait(fullname, callbacks)  # not found (or a namespace package): wait on
                return spec
            spec.loader = _AfterImportLoader(self, spec.loader, callbacks)
            return spec

    def wait(self, name: str, callbacks: List[Callable]) -> None:
        """Run ``callbacks`` after the next import of ``name``."""
        with self._lock:
            self.waiting.setdefault(name, []).extend(callbacks)

    def _others_spec(self, fullname, path, target):
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


def _finder() -> AfterImportFinder:
    """The process's one :class:`AfterImportFinder`, first on ``sys.meta_path``."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "AfterImportFinder" and hasattr(finder, "waiting"):
            return finder
    finder = AfterImportFinder()
    sys.meta_path.insert(0, finder)
    return finder


def after_import(name: str, callback: Callable) -> None:
    """Run ``callback(module)`` once the module ``name`` is imported: now if it is, else when its
    import has executed it (before the importing statement returns)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    else:
        _finder().wait(name, [callback])


# ------------------------------------------------------------------ the notes
def add_location(registry, location: str = LOCATION) -> bool:
    """Put ``location`` among ``registry``'s ``_locations`` (imported by its next ``get``).
    Returns whether it was added (``False``: it was there)."""
    if location in registry._locations:
        return False
    # A new list: mmengine shares one default list between the registries made without locations.
    registry._locations = [*registry._locations, location]
    # Looked up before: the next get imports the locations again (the imported ones cost nothing).
    registry._imported = False
    return True


def _add_locations(module) -> None:
    add_location(module.MODELS)
    if hasattr(module, "OPTIM_WRAPPERS"):  # (the swin_backbone scope has MODELS alone)
        add_location(module.OPTIM_WRAPPERS, OPTIM_LOCATION)


def _add_optim_location(root) -> None:
    add_location(root.OPTIM_WRAPPERS, OPTIM_LOCATION)


def _add_config_scope(utils) -> None:
    utils.MODULE2PACKAGE.setdefault(CONFIG_SCOPE, CONFIG_PACKAGE)


def _register_checkpoint_loader(_module) -> None:
    # mmengine's CheckpointLoader reads local files, URLs and references through our unpickler.
    importlib.import_module("swin_backbone.checkpoint.mmengine_schemes").register()


def _plug_into_backbones(_module) -> None:
    # The backbones' load_state_dict key converter and the 'Pretrained' initializer.
    importlib.import_module("swin_backbone.checkpoint.hooks")


#: What :func:`plug_in` waits for: module -> what it does there.
NOTES = (
    ("mmengine.config.utils", _add_config_scope),
    *((name, _add_locations) for name in REGISTRY_MODULES),
    ("mmengine.registry.root", _add_optim_location),
    ("mmengine.runner.checkpoint", _register_checkpoint_loader),
    ("swin_backbone.model.backbone", _plug_into_backbones),
)


_PLUGGED: set = set()


def plug_in(notes: Sequence = NOTES) -> None:
    """Leave the notes of :data:`NOTES` (the module's docstring); each one once per process."""
    for name, callback in notes:
        if (name, callback) not in _PLUGGED:
            _PLUGGED.add((name, callback))
            after_import(name, callback)


def installed(libraries: Sequence[str] = LIBRARIES) -> List[str]:
    """Which of ``libraries`` can be imported here (found, not imported)."""
    from importlib.util import find_spec

    found = []
    for lib in libraries:
        try:
            if find_spec(lib) is not None:
                found.append(lib)
        except (ImportError, ValueError):
            continue
    return found


__all__ = ["AfterImportFinder", "CONFIG_PACKAGE", "CONFIG_SCOPE", "LIBRARIES", "LOCATION", "NOTES", "OPTIM_LOCATION",
           "REGISTRY_MODULES", "add_location", "after_import", "installed", "plug_in"]
