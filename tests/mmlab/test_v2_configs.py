"""Swin V2 configs: every one builds with SwinV2Backbone, the right windows and V2's no-decay
keys; the toy V2 Mask R-CNN and UPerNet train a few iterations through tools/train.py."""
import os
import sys

import pytest
import torch

from swin_backbone import SwinV2Backbone

from ..helpers import CONFIG_ROOT, CONFIGS, FAST, iters, run_tool, scalars
from ..helpers import build_config as _build

V2_CONFIGS = [p for p in CONFIGS if "swinv2" in os.path.basename(p)]

#: config -> (arch embed dims, window, pretrained windows)
EXPECTED = {
    "mmdet/cascade-mask-rcnn_swinv2-l-p4-w16_fpn_fsdp_ms-crop-3x_coco.py": (192, 16, (12, 12, 12, 6)),
    "mmseg/upernet_swinv2-l-w16_fsdp_512x512_160k_ade20k.py": (192, 16, (12, 12, 12, 6)),
    "mmdet/mask-rcnn_swinv2-t-p4-w8_fpn_1x_coco.py": (96, 8, (0, 0, 0, 0)),
    "mmdet/mask-rcnn_swinv2-t-p4-w8_fpn_ms-crop-3x_coco.py": (96, 8, (0, 0, 0, 0)),
    "mmdet/mask-rcnn_swinv2-t-p4-w16_fpn_ms-crop-3x_coco.py": (96, 16, (0, 0, 0, 0)),
    "mmdet/mask-rcnn_swinv2-s-p4-w8_fpn_ms-crop-3x_coco.py": (96, 8, (0, 0, 0, 0)),
    "mmdet/mask-rcnn_swinv2-b-p4-w16_fpn_ms-crop-3x_coco.py": (128, 16, (12, 12, 12, 6)),
    "mmdet/cascade-mask-rcnn_swinv2-t-p4-w8_fpn_ms-crop-3x_coco.py": (96, 8, (0, 0, 0, 0)),
    "mmseg/upernet_swinv2-t-w8_512x512_160k_ade20k.py": (96, 8, (0, 0, 0, 0)),
    "mmseg/upernet_swinv2-t-w16_512x512_160k_ade20k.py": (96, 16, (0, 0, 0, 0)),
    "mmseg/upernet_swinv2-s-w16_512x512_160k_ade20k.py": (96, 16, (0, 0, 0, 0)),
    "mmseg/upernet_swinv2-b-w16_512x512_160k_ade20k.py": (128, 16, (12, 12, 12, 6)),
    "toy/mask-rcnn_swinv2-toy_fpn_toy-coco.py": (48, 8, (0, 0, 0, 0)),
    "toy/upernet_swinv2-toy_toy-ade.py": (32, 8, (0, 0, 0, 0)),
}


def test_v2_config_list_is_complete():
    assert sorted(os.path.relpath(p, CONFIG_ROOT) for p in V2_CONFIGS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", V2_CONFIGS, ids=lambda p: os.path.relpath(p, CONFIG_ROOT))
def test_v2_config_builds(path):
    cfg, model = _build(path)
    backbone = model.backbone
    assert isinstance(backbone, SwinV2Backbone)
    dims, window, pretrained = EXPECTED[os.path.relpath(path, CONFIG_ROOT)]
    assert (backbone.embed_dims, backbone.window_size, backbone.pretrained_window_sizes) == (dims, window, pretrained)
    keys = cfg.optim_wrapper.paramwise_cfg.custom_keys
    for key in ("cpb_mlp", "logit_scale", "norm"):  # official no_weight_decay_keywords + norms
        assert keys[key]["decay_mult"] == 0.0
    init = cfg.model.backbone.get("init_cfg")
    assert init is None or "://" not in init["checkpoint"]
    # the neck / decode head take the backbone's channels
    with torch.no_grad():
        outs = backbone(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == list(backbone.num_features)


@pytest.mark.parametrize("config,metric", [("configs/toy/mask-rcnn_swinv2-toy_fpn_toy-coco.py", "coco/bbox_mAP"),
                                           ("configs/toy/upernet_swinv2-toy_toy-ade.py", "mIoU")])
def test_toy_v2_trains_through_tools_train(tmp_path, toy_data, config, metric):  # noqa: F811
    work = str(tmp_path / "work")
    out = run_tool([sys.executable, "tools/train.py", config, "--work-dir", work, "--cfg-options", *FAST, *iters(4)],
                   toy_data)
    assert os.path.isfile(os.path.join(work, "iter_4.pth"))
    assert any(metric in row for row in scalars(work))
    assert "SwinV2Backbone" in out or os.path.isfile(os.path.join(work, "iter_4.pth"))
    state = torch.load(os.path.join(work, "iter_4.pth"), map_location="cpu", weights_only=False)["state_dict"]
    assert any(k.endswith("attn.cpb_mlp.0.weight") for k in state)
