"""The ``swin_backbone`` registry scope.

A config inherited as ``_base_ = 'swin_backbone::<path>'`` gets ``_scope_='swin_backbone'`` on
each of its outermost ``type`` dicts that has no scope yet (mmengine marks every external base
that way). Building one, mmengine imports this module and looks for the registry of that scope:
this ``MODELS`` holds ``SwinBackbone`` (so e.g. ``{{_base_.swin_t}}`` from
``swin_backbone::_base_/swin_backbone.py`` builds without a warning) and falls back to its
parent, mmengine's root ``MODELS``. The shipped configs name ``_scope_='mmdet'`` / ``'mmseg'``
on the few type dicts of their own that are not merged into an mmdet / mmseg base dict.
"""
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import Registry

MODELS = Registry("model", parent=MMENGINE_MODELS, scope="swin_backbone", locations=["swin_backbone"])
