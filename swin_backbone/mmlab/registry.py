"""Registration of SwinBackbone and SwinV2Backbone (and the data preprocessors) into the OpenMMLab
``MODELS`` registries: importing this module registers them.

mmengine imports it: it is among the ``_locations`` of each installed library's ``MODELS`` (and of
the ``swin_backbone`` scope's, :mod:`swin_backbone.registry`), which ``import swin_backbone`` puts
there (:mod:`swin_backbone.mmlab`), and which mmengine's ``Registry.get`` imports the first time
it looks a name up. Each library is optional: the package imports (and SwinBackbone works as a
plain ``nn.Module``) without mmdet or mmseg; where one is installed, ``type='SwinBackbone'``
builds our backbone inside its configs.
"""
from __future__ import annotations

import importlib
from typing import List

from . import CONFIG_PACKAGE, CONFIG_SCOPE, LIBRARIES, REGISTRY_MODULES  # noqa: F401  (re-exported)


def register(module: type, name: str = "SwinBackbone") -> List[str]:
    """Register ``module`` under ``name`` in every installed library's ``MODELS`` (and in the
    ``swin_backbone`` scope's, :mod:`swin_backbone.registry`).

    Returns the names of the libraries it was registered in.
    """
    from ..registry import MODELS

    if MODELS.module_dict.get(name) is not module:
        MODELS.register_module(name=name, module=module, force=True)
    done = []
    for lib in LIBRARIES:
        try:
            registry = importlib.import_module(f"{lib}.registry").MODELS
        except ImportError:
            continue
        # module_dict, not get(): get() first imports the library's models (mmdet.models, ...),
        # which need mmcv's ops: registering must not depend on them.
        if registry.module_dict.get(name) is not module:
            registry.register_module(name=name, module=module, force=True)
        done.append(lib)
    return done


def register_all():
    """Register the backbones and the preprocessors. Returns the libraries SwinBackbone is
    registered in and the preprocessors registered (:data:`REGISTERED_IN`, :data:`PREPROCESSORS`)."""
    from .. import checkpoint  # noqa: F401  (the backbones' checkpoint key converter, 'Pretrained' init)
    from ..model.backbone import SwinBackbone
    from ..model.v2 import SwinV2Backbone
    from .preprocessors import register_preprocessors

    registered_in = register(SwinBackbone)
    register(SwinV2Backbone, "SwinV2Backbone")
    return registered_in, register_preprocessors()


#: The libraries whose ``MODELS`` hold SwinBackbone (``swin_backbone.REGISTERED_IN``).
#: ``SwinDetDataPreprocessor`` / ``SwinSegDataPreProcessor`` registered where mmdet / mmseg are
#: installed (``swin_backbone.PREPROCESSORS``, :mod:`swin_backbone.mmlab.preprocessors`).
REGISTERED_IN, PREPROCESSORS = register_all()
