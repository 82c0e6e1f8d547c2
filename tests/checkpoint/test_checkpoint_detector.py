"""Whole-model checkpoints: an mmdet Mask R-CNN Swin-T checkpoint (mmdet's own backbone, the
model-zoo layout) loads into our Mask R-CNN config through load_from's code path, with no
missing or unexpected keys and the same predictions; init_cfg=Pretrained loads any format;
tools/model_converters/convert_checkpoint.py writes loadable files."""
import os
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import DefaultScope
from mmengine.runner import load_checkpoint as mmengine_load_checkpoint

import swin_backbone
from swin_backbone import SwinBackbone, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build_det(cfg):
    from mmdet.registry import MODELS

    with DefaultScope.overwrite_default_scope("mmdet"):
        return MODELS.build(cfg.model)


def test_mmdet_maskrcnn_checkpoint_loads_into_our_config(tmp_path):
    from mmdet.testing import demo_mm_inputs

    base = tmp_path / "mmdet_swin.py"
    base.write_text("_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'\n")
    ref_cfg = Config.fromfile(str(base))  # mmdet's own Swin Mask R-CNN, its own backbone
    ref_cfg.model.backbone.init_cfg = None
    ref_cfg.model.backbone.depths = [2, 2, 2, 2]
    ref = _build_det(ref_cfg)
    ref.init_weights()
    path = tmp_path / "mask_rcnn_swin_t_mmdet.pth"
    torch.save({"state_dict": ref.state_dict(), "meta": {"mmdet_version": "3.3.0"}}, path)

    ours_cfg = Config.fromfile(os.path.join(ROOT, "configs/mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py"))
    ours_cfg.model.backbone.update(init_cfg=None, mask_padding=False, depths=(2, 2, 2, 2), arch=None,
                                   embed_dims=96, num_heads=(3, 6, 12, 24))
    ours = _build_det(ours_cfg)
    assert isinstance(ours.backbone, SwinBackbone)
    # the Runner's load_from path: mmengine.runner.load_checkpoint -> our state-dict pre-hook
    mmengine_load_checkpoint(ours, str(path), map_location="cpu", strict=True)
    # and plain torch strict loading reports nothing missing or unexpected either
    result = ours.load_state_dict(torch.load(path, weights_only=True)["state_dict"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys

    data = demo_mm_inputs(batch_size=1, image_shapes=[(3, 150, 203)], num_items=[2], num_classes=80, with_mask=True)
    with torch.no_grad(), DefaultScope.overwrite_default_scope("mmdet"):
        ref.eval()
        ours.eval()
        batch_ref = ref.data_preprocessor(data, False)
        batch_ours = ours.data_preprocessor(data, False)
        for a, b in zip(ref.extract_feat(batch_ref["inputs"]), ours.extract_feat(batch_ours["inputs"])):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        pa = ref.predict(batch_ref["inputs"], batch_ref["data_samples"])[0].pred_instances
        pb = ours.predict(batch_ours["inputs"], batch_ours["data_samples"])[0].pred_instances
    assert len(pa) == len(pb) > 0
    torch.testing.assert_close(pb.bboxes, pa.bboxes, rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(pb.scores, pa.scores, rtol=1e-3, atol=1e-4)


def test_init_cfg_pretrained_loads_any_format(tmp_path):
    from torchvision.models import swin_t

    tv = swin_t(weights=None)
    path = tmp_path / "tv.pth"
    torch.save(tv.state_dict(), path)
    model = SwinBackbone("tiny", out_indices=(3,), init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    model.init_weights()
    torch.testing.assert_close(model.patch_embed.proj.weight, tv.features[0][0].weight)
    torch.testing.assert_close(model.norm3.weight, tv.norm.weight)
    # a registry-built backbone does the same
    from mmdet.registry import MODELS

    built = MODELS.build(dict(type="SwinBackbone", arch="tiny", out_indices=(3,),
                              init_cfg=dict(type="Pretrained", checkpoint=str(path))))
    built.init_weights()
    torch.testing.assert_close(built.stages[2].blocks[5].mlp.fc2.weight, tv.features[5][5].mlp[3].weight)
    # a missing file is a clear error, not a silent random init
    broken = SwinBackbone("tiny", init_cfg=dict(type="Pretrained", checkpoint=str(tmp_path / "nope.pth")))
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        broken.init_weights()


@pytest.mark.slow  # tools/model_converters/convert_checkpoint.py as a subprocess
@pytest.mark.parametrize("to", ["ours", "mmdet", "official"])
def test_convert_checkpoint_tool(tmp_path, to):
    from torchvision.models import swin_t

    tv = swin_t(weights=None).eval()
    src = tmp_path / "tv.pth"
    torch.save(tv.state_dict(), src)
    dst = tmp_path / f"converted_{to}.pth"
    proc = subprocess.run([sys.executable, "tools/model_converters/convert_checkpoint.py", str(src), str(dst), "--to", to],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert "format 'torchvision'" in proc.stdout and "wrote" in proc.stdout
    saved = torch.load(dst, weights_only=True)
    assert saved["meta"]["swin_backbone_format"] == to
    keys = list(saved["state_dict"])
    assert swin_backbone.detect_format(keys) == {"ours": "ours", "mmdet": "mmdet", "official": "official"}[to]
    model = SwinBackbone("tiny", out_indices=(3,), pad_small_map=False).eval()
    report = load_checkpoint(model, str(dst))
    assert report.complete, report.summary()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], tv.norm(tv.features(x)).permute(0, 3, 1, 2), rtol=1e-4, atol=1e-4)
