"""The models ``swin-benchmark`` compares: Swin-T as ours and mmdet's with the same weights,
timm's and torchvision's Swin-T, and Swin V2-T as ours, timm's and torchvision's with the same
weights. Every peer library is optional: a builder returns the models that are installed."""
from __future__ import annotations

import importlib.util
from typing import Dict, Sequence, Tuple

import torch

from swin_backbone import SwinBackbone, SwinV2Backbone, load_checkpoint

ARCH = dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7)

#: The peer libraries the rows compare with (none is needed: a plain install times ours alone):
#: module -> (what is skipped without it, how to install it).
PEERS: Dict[str, Tuple[str, str]] = {
    "mmdet": ("mmdet's SwinTransformer rows (the speedup reference and memory ratio; speedups are then over ours)",
              "pip install 'swin-backbone[mmdet]'"),
    "timm": ("timm's rows (and the Swin V2 rows' reference weights)", "pip install timm"),
    "torchvision": ("torchvision's rows", "pip install torchvision"),
    "mmseg": ("--upernet (an mmseg UPerNet)", "pip install 'swin-backbone[mmseg]'"),
}


def installed(module: str) -> bool:
    """``module`` can be imported (checked without importing it)."""
    return importlib.util.find_spec(module) is not None


def build_pair(device: str, seed: int = 0) -> Dict[str, torch.nn.Module]:
    """mmdet's SwinTransformer and ours (Swin-T) with identical weights; without mmdet, ours
    alone (its own initialisation, seeded)."""
    torch.manual_seed(seed)
    if not installed("mmdet"):
        ours = SwinBackbone(arch=None, **ARCH, drop_path_rate=0.0)
        ours.init_weights()
        return {"ours": ours.to(device)}
    from mmdet.models.backbones import SwinTransformer

    ref = SwinTransformer(**ARCH, drop_path_rate=0.0)
    ref.init_weights()
    ours = SwinBackbone(arch=None, **ARCH, drop_path_rate=0.0)
    load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    return {"mmdet": ref.to(device), "ours": ours.to(device)}


def build_peers(device: str, size: Sequence[int]) -> Dict[str, torch.nn.Module]:
    """timm's and torchvision's Swin-T feature extractors (random weights), where installed."""
    peers: Dict[str, torch.nn.Module] = {}
    try:
        import timm

        peers["timm"] = timm.create_model(
            "swin_tiny_patch4_window7_224", pretrained=False, features_only=True, img_size=tuple(size),
            strict_img_size=False,
        )
    except ImportError:
        pass
    try:
        from torchvision.models import swin_t

        peers["torchvision"] = swin_t(weights=None).features
    except ImportError:
        pass
    return {k: m.to(device).eval() for k, m in peers.items()}


#: timm's Swin V2 model that the V2 rows compare with (ours: ``SwinV2Backbone('tiny', window_size=8)``).
V2_TIMM = "swinv2_tiny_window8_256"


def build_v2(device: str, size: Sequence[int], peers: bool = True, seed: int = 0) -> Dict[str, torch.nn.Module]:
    """Swin V2-T window 8: ours, timm's (features_only, built for ``size``) and torchvision's
    ``swin_v2_t`` features, where installed, all with the same weights and no stochastic depth.

    The weights are timm's random initialisation: loaded into ours through the checkpoint
    loader (timm-v2 format; our stage 1-3 output norms, which a classification model lacks,
    stay unit LayerNorms) and into torchvision through our torchvision-v2 writer.
    """
    from swin_backbone.checkpoint.formats_v2 import ours_v2_to_torchvision

    torch.manual_seed(seed)
    ours = SwinV2Backbone("tiny", window_size=8, drop_path_rate=0.0)
    models: Dict[str, torch.nn.Module] = {"ours": ours}
    try:
        import timm
    except ImportError:
        timm = None
    if timm is not None:
        full = timm.create_model(V2_TIMM, pretrained=False, drop_path_rate=0.0)
        load_checkpoint(ours, full.state_dict(), logger=None)
        if peers:
            feats = timm.create_model(V2_TIMM, pretrained=False, features_only=True, img_size=tuple(size),
                                      strict_img_size=False, drop_path_rate=0.0)
            state = {k.replace("layers.", "layers_", 1): v for k, v in full.state_dict().items()
                     if k.startswith(("patch_embed.", "layers."))}
            feats.load_state_dict(state, strict=True)
            models["timm"] = feats
    else:
        ours.init_weights()
    if peers:
        try:
            from torchvision.models import swin_v2_t
            from torchvision.ops import StochasticDepth
        except ImportError:
            swin_v2_t = None
        if swin_v2_t is not None:
            tv = swin_v2_t(weights=None)
            _, unexpected = tv.load_state_dict(ours_v2_to_torchvision(ours.state_dict()), strict=False)
            if unexpected:
                raise RuntimeError(f"torchvision swin_v2_t: unexpected keys from our converter: {unexpected[:5]}")
            for m in tv.modules():
                if isinstance(m, StochasticDepth):
                    m.p = 0.0
            models["torchvision"] = tv.features
    return {k: m.to(device) for k, m in models.items()}
