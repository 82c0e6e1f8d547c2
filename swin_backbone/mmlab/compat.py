"""Compatibility shims for the pinned stack (torch 2.14 + mmengine 0.10.7): mmengine Runner
checkpoints under weights-only loading live in :mod:`swin_backbone.checkpoint.allowlist`
(``import swin_backbone`` runs :func:`allow_mmengine_checkpoints`)."""
from __future__ import annotations

from ..checkpoint.allowlist import allow_mmengine_checkpoints

__all__ = ["allow_mmengine_checkpoints"]
