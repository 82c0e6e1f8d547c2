"""Registration of SwinBackbone into the OpenMMLab ``MODELS`` registries.

Each library is optional: the package imports (and SwinBackbone works as a plain
``nn.Module``) without mmdet or mmseg; where one is installed, ``type='SwinBackbone'``
builds our backbone inside its configs.
"""
from __future__ import annotations

import importlib
from typing import List

#: Registries that receive SwinBackbone, by importable module path.
REGISTRY_MODULES = ("mmdet.registry", "mmseg.registry", "mmpretrain.registry")


def register(module: type, name: str = "SwinBackbone") -> List[str]:
    """Register ``module`` under ``name`` in every installed library's ``MODELS``.

    Returns the names of the libraries it was registered in.
    """
    done = []
    for path in REGISTRY_MODULES:
        try:
            registry = importlib.import_module(path).MODELS
        except ImportError:
            continue
        if registry.get(name) is not module:
            registry.register_module(name=name, module=module, force=True)
        done.append(path.split(".")[0])
    return done
