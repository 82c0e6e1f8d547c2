"""Registration of SwinBackbone into the OpenMMLab ``MODELS`` registries, and of the
``swin_backbone::`` config scope into mmengine.

Each library is optional: the package imports (and SwinBackbone works as a plain
``nn.Module``) without mmdet or mmseg; where one is installed, ``type='SwinBackbone'``
builds our backbone inside its configs.
"""
from __future__ import annotations

import importlib
from typing import List

#: Registries that receive SwinBackbone, by importable module path.
REGISTRY_MODULES = ("mmdet.registry", "mmseg.registry", "mmpretrain.registry")

#: The ``package::`` scope of the configs shipped in ``swin_backbone/.mim/configs``:
#: ``_base_ = 'swin_backbone::mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'``.
CONFIG_SCOPE = "swin_backbone"

#: What mmengine's ``get_installed_path`` is given for the scope. Not the distribution name
#: (``swin-backbone``): for that mmengine answers ``<site-packages>/swin_backbone``, which an
#: editable install does not have. A module path that is no distribution's name takes its
#: ``importlib`` branch instead, which answers this package's directory in wheel and editable
#: installs alike (the directory of ``swin_backbone/registry.py``).
CONFIG_PACKAGE = "swin_backbone.registry"


def register(module: type, name: str = "SwinBackbone") -> List[str]:
    """Register ``module`` under ``name`` in every installed library's ``MODELS`` (and in the
    ``swin_backbone`` scope's, :mod:`swin_backbone.registry`).

    Returns the names of the libraries it was registered in.
    """
    from ..registry import MODELS

    if MODELS.get(name) is not module:
        MODELS.register_module(name=name, module=module, force=True)
    done = []
    for path in REGISTRY_MODULES:
        try:
            registry = importlib.import_module(path).MODELS
        except ImportError:
            continue
        # module_dict, not get(): get() first imports the library's models (mmdet.models, ...),
        # which need mmcv's ops: registering must not depend on them.
        if registry.module_dict.get(name) is not module:
            registry.register_module(name=name, module=module, force=True)
        done.append(path.split(".")[0])
    return done


def register_config_scope() -> bool:
    """Make ``swin_backbone::<path>`` config paths resolvable by mmengine.

    mmengine 0.10 only accepts the scopes listed in its ``MODULE2PACKAGE`` table (an
    ``AssertionError: mmengine does not support to load swin_backbone config`` otherwise),
    and reads the table while it parses ``_base_``, before the config's ``custom_imports``
    run: ``swin_backbone`` has to be imported before the config is loaded (``swin-train`` and
    ``swin-test`` do; mmdet's and mmseg's own tools read the shipped configs by file, whose bases
    are relative and ``mmdet::`` / ``mmseg::``). Returns whether mmengine's config module was found.
    """
    try:
        from mmengine.config import utils
    except ImportError:  # pragma: no cover - mmengine is a requirement
        return False
    utils.MODULE2PACKAGE.setdefault(CONFIG_SCOPE, CONFIG_PACKAGE)
    return True


register_config_scope()
