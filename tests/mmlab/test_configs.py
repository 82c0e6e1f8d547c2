"""Every shipped config loads (from its file and through the ``swin_backbone::`` scope), builds
its model (SwinBackbone inside), and runs a loss and a predict forward on a small fake batch."""
import os

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import DefaultScope

import swin_backbone
from swin_backbone import SwinBackbone

from ..helpers import CONFIG_ROOT, CONFIGS, ROOT
from ..helpers import build_config as _build

# What mmengine's Runner builds from a config.
RUNNER_KEYS = ("model", "train_dataloader", "val_dataloader", "test_dataloader", "val_evaluator", "test_evaluator",
               "train_cfg", "val_cfg", "test_cfg", "optim_wrapper", "param_scheduler", "default_hooks",
               "custom_hooks", "env_cfg", "visualizer", "log_processor")


def test_config_list_is_complete():
    names = {os.path.relpath(p, CONFIG_ROOT) for p in CONFIGS}
    for expected in [
        "mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py",
        "mmdet/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py",
        "mmdet/mask-rcnn_swin-s-p4-w7_fpn_ms-crop-3x_coco.py",
        "mmdet/cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py",
        "mmdet/retinanet_swin-t-p4-w7_fpn_1x_coco.py",
        "mmseg/upernet_swin-t_512x512_160k_ade20k.py",
        "mmseg/upernet_swin-s_512x512_160k_ade20k.py",
        "mmseg/upernet_swin-b_512x512_160k_ade20k.py",
        "mmseg/fpn_swin-t_512x512_160k_ade20k.py",
        "toy/mask-rcnn_swin-toy_fpn_toy-coco.py",
        "toy/upernet_swin-toy_toy-ade.py",
    ]:
        assert expected in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_config_builds(path):
    cfg, model = _build(path)
    assert isinstance(model.backbone, SwinBackbone)
    assert cfg.custom_imports["imports"] == ["swin_backbone"]
    init = cfg.model.backbone.get("init_cfg")
    assert init is None or "://" not in init["checkpoint"]  # never a URL download
    # the Swin recipe: no weight decay on norms and position tables
    assert "relative_position_bias_table" in cfg.optim_wrapper.paramwise_cfg.custom_keys
    assert cfg.optim_wrapper.optimizer.type == "AdamW"


def _scopes(value, path="", found=None):
    """``{path: _scope_}`` of every dict in ``value`` that carries a ``_scope_``."""
    found = {} if found is None else found
    if isinstance(value, dict):
        if "_scope_" in value:
            found[path] = value["_scope_"]
        for k, v in value.items():
            _scopes(v, f"{path}.{k}", found)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _scopes(v, f"{path}[{i}]", found)
    return found


def _without_scopes(value):
    if isinstance(value, dict):
        return {k: _without_scopes(v) for k, v in value.items() if k != "_scope_"}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_scopes(v) for v in value)
    return value


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_config_inherited_through_package_scope(path, tmp_path, monkeypatch):
    """A user config ``_base_ = 'swin_backbone::<path>'`` (resolved in this checkout's package
    directory, editable install or not) reads the same config, and mmengine's marking of an
    external base leaves no type dict the Runner builds with the ``swin_backbone`` scope (whose
    registries hold no detectors or datasets): each keeps its library's."""
    monkeypatch.setenv("TOY_DATA_ROOT", "data")
    rel = os.path.relpath(path, CONFIG_ROOT)
    user = tmp_path / "user.py"
    user.write_text(f"_base_ = 'swin_backbone::{rel}'\n")
    inherited, direct = Config.fromfile(str(user)), Config.fromfile(path)
    assert os.path.join("swin_backbone", ".mim", "configs", rel) in inherited.text
    scope = direct.default_scope
    assert inherited.default_scope == scope
    found = {}
    for key in RUNNER_KEYS:
        _scopes(inherited.get(key), key, found)
    assert found and {p: s for p, s in found.items() if s != scope} == {}
    assert _without_scopes(inherited.to_dict()) == _without_scopes(direct.to_dict())


def test_package_scope_resolves_to_this_package():
    from mmengine.config.utils import MODULE2PACKAGE
    from mmengine.utils import get_installed_path

    assert os.path.realpath(get_installed_path(MODULE2PACKAGE["swin_backbone"])) == os.path.realpath(
        os.path.dirname(swin_backbone.__file__))
    assert os.path.realpath(os.path.join(ROOT, "configs")) == os.path.realpath(CONFIG_ROOT)


def _det_batch(num_classes):
    from mmdet.testing import demo_mm_inputs

    return demo_mm_inputs(batch_size=2, image_shapes=[(3, 96, 128), (3, 80, 120)], num_items=[2, 3],
                          num_classes=num_classes, with_mask=True)


def _seg_batch(num_classes):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample

    inputs, samples = [], []
    for h, w in [(96, 128), (96, 128)]:  # mmseg predicts same-size batches only
        inputs.append(torch.randint(0, 255, (3, h, w), dtype=torch.uint8))
        s = SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w)))
        s.gt_sem_seg = PixelData(data=torch.randint(0, num_classes, (1, h, w)))
        samples.append(s)
    return dict(inputs=inputs, data_samples=samples)


FORWARD = {
    "mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py": ("det", 80),
    "mmdet/cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py": ("det", 80),
    "mmdet/retinanet_swin-t-p4-w7_fpn_1x_coco.py": ("det", 80),
    "mmseg/upernet_swin-t_512x512_160k_ade20k.py": ("seg", 150),
    "mmseg/fpn_swin-t_512x512_160k_ade20k.py": ("seg", 150),
}


def _fewer_proposals(cfg):
    """64 RPN proposals and 64 sampled RoIs per image in place of 1000 and 512 (a cascade's three
    heads of four convolutions each took a minute on 2000 RoIs): the backbone sees the same."""
    train, test = cfg.model.get("train_cfg", {}), cfg.model.get("test_cfg", {})
    if "rpn_proposal" in train:
        train.rpn_proposal.max_per_img = 64
    rcnn = train.get("rcnn") or []
    for stage in rcnn if isinstance(rcnn, list) else [rcnn]:  # (a cascade has one per stage)
        stage.sampler.num = 64
    if "rpn" in test:
        test.rpn.max_per_img = 64


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_loss_and_predict_forward(name):
    kind, num_classes = FORWARD[name]
    cfg, model = _build(os.path.join(CONFIG_ROOT, name), edit=_fewer_proposals)
    if kind == "seg":
        model.data_preprocessor.size = None  # keep the fake images' own sizes, padded to 32
        model.data_preprocessor.size_divisor = 32
    model.init_weights = lambda: None
    data = _det_batch(num_classes) if kind == "det" else _seg_batch(num_classes)
    with DefaultScope.overwrite_default_scope(cfg.default_scope):
        model.train()
        batch = model.data_preprocessor(data, True)
        losses = model(**batch, mode="loss")
        total = sum(v.sum() for k, v in losses.items() if "loss" in k and isinstance(v, torch.Tensor)) + sum(
            sum(x.sum() for x in v) for k, v in losses.items() if "loss" in k and isinstance(v, list))
        assert torch.isfinite(total)
        total.backward()
        assert model.backbone.patch_embed.proj.weight.grad is not None
        model.eval()
        with torch.no_grad():
            batch = model.data_preprocessor(data, False)
            preds = model(**batch, mode="predict")
    assert len(preds) == 2
    if kind == "det":
        assert "pred_instances" in preds[0]
    else:
        assert preds[0].pred_sem_seg.data.shape[-2:] == batch["data_samples"][0].img_shape
