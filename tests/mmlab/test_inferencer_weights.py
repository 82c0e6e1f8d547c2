"""mmdet's ``DetInferencer`` given weights alone (``model=None``), as ``image_demo.py img x.pth``
runs it: mmengine builds the model from the config text the checkpoint holds
(``Config.fromstring``, which executes it). Through the package's reader the text is kept where
it is a plain config (what mmengine's Runner writes) and dropped, with a warning, where running
it could do anything else; the config's own ``custom_imports`` then register SwinBackbone."""
import os
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("mmdet")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = os.path.join(ROOT, "configs", "toy", "mask-rcnn_swin-toy_fpn_toy-coco.py")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A toy Mask R-CNN + SwinBackbone checkpoint as mmengine's Runner saves one: the state dict,
    ``meta['cfg']`` and the message hub's ``runtime_info['cfg']`` (the config's pretty text)."""
    from mmdet.registry import MODELS
    from mmengine.config import Config
    from mmengine.registry import DefaultScope

    cfg = Config.fromfile(TOY)
    with DefaultScope.overwrite_default_scope("mmdet"):
        torch.manual_seed(0)
        model = MODELS.build(cfg.model)
    path = tmp_path_factory.mktemp("weights") / "det.pth"
    torch.save(dict(state_dict=model.state_dict(), meta=dict(cfg=cfg.pretty_text, epoch=1),
                    message_hub=dict(log_scalars={}, runtime_info=dict(cfg=cfg.pretty_text), resumed_keys={})), path)
    return path, model


def _image():
    return np.random.RandomState(0).randint(0, 255, (96, 128, 3), dtype=np.uint8)


def test_weights_alone_build_the_model_from_the_plain_config_text(weights):
    from mmdet.apis import DetInferencer

    path, model = weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inferencer = DetInferencer(model=None, weights=str(path), device="cpu")
    assert not [w for w in caught if "dropped" in str(w.message)]
    assert type(inferencer.model.backbone).__name__ == "SwinBackbone"
    torch.testing.assert_close(inferencer.model.state_dict()["backbone.patch_embed.proj.weight"],
                               model.state_dict()["backbone.patch_embed.proj.weight"])
    out = inferencer(_image(), return_datasamples=False, no_save_vis=True)
    assert len(out["predictions"]) == 1


@pytest.mark.parametrize("where", ["meta", "message_hub"])
def test_a_config_text_that_runs_code_is_dropped_before_mmengine_runs_it(weights, tmp_path, where):
    from mmdet.apis import DetInferencer

    path, model = weights
    marker = tmp_path / "ran"
    text = f"ran = __import__('os').system('touch {marker}')\nmodel = dict(type='MaskRCNN')\n"
    checkpoint = dict(state_dict=model.state_dict(), meta=dict(epoch=1))
    if where == "meta":
        checkpoint["meta"]["cfg"] = text
        name = r"meta\['cfg'\]"
    else:
        checkpoint["message_hub"] = dict(log_scalars={}, runtime_info=dict(cfg=text), resumed_keys={})
        name = r"message_hub\['runtime_info'\]\['cfg'\] dropped"
    evil = tmp_path / "evil.pth"
    torch.save(checkpoint, evil)
    with pytest.warns(UserWarning, match=name + r".*line 1 holds \"__import__"), \
            pytest.raises((ValueError, AssertionError, KeyError)):
        DetInferencer(model=None, weights=str(evil), device="cpu")
    assert not marker.exists()
    # the control: what mmengine would have run
    from mmengine.config import Config

    Config.fromstring(text, file_format=".py")
    assert marker.exists()
