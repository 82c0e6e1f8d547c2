"""A package's public names loaded on first use (PEP 562): one implementation for every package
that keeps its import cheap (:mod:`swin_backbone`, :mod:`swin_backbone.checkpoint`). Stdlib only."""
import importlib
import importlib.util
import sys
from typing import Callable, Dict, List, Tuple


def lazy_names(package: str, table: Dict[str, str]) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for the module ``package`` (its ``__name__``), assigned by it.

    ``table`` maps a public name to the submodule, relative to ``package``, that defines it; the
    value is imported on first access and kept in the package's namespace (later lookups do not
    come here). Any other name that is a submodule imports as ``import`` gives it.
    """
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
