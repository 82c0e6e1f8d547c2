"""mmdet's ``DetInferencer`` and the config text a checkpoint holds. Given weights alone
(``model=None``, as ``image_demo.py img x.pth`` runs it) mmengine executes the text
(``Config.fromstring``) and builds what it names, importing any dotted name its registries do not
know: a "config" ``model = dict(type='os.system', command=...)`` runs a shell. Through the
package's reader no such text reaches mmengine; with the model config the inferencer runs as
always."""
import os

import numpy as np
import pytest
import torch

pytest.importorskip("mmdet")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOY = os.path.join(ROOT, "configs", "toy", "mask-rcnn_swin-toy_fpn_toy-coco.py")


@pytest.fixture(scope="module")
def model():
    from mmdet.registry import MODELS
    from mmengine.config import Config
    from mmengine.registry import DefaultScope

    with DefaultScope.overwrite_default_scope("mmdet"):
        torch.manual_seed(0)
        return MODELS.build(Config.fromfile(TOY).model)


@pytest.mark.parametrize("where", ["meta", "message_hub"])
def test_a_config_text_in_the_weights_never_reaches_mmengine(model, tmp_path, where):
    from mmdet.apis import DetInferencer
    from mmdet.registry import MODELS
    from mmengine.config import Config

    marker = tmp_path / "ran"
    text = f"model = dict(type='os.system', command='touch {marker}')\n"  # plain data, as mmengine writes configs
    checkpoint = dict(state_dict=model.state_dict(), meta=dict(epoch=1))
    if where == "meta":
        checkpoint["meta"]["cfg"] = text
    else:
        checkpoint["message_hub"] = dict(log_scalars={}, runtime_info=dict(cfg=text), resumed_keys={})
    path = tmp_path / "weights.pth"
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="Cannot find the config"):
        DetInferencer(model=None, weights=str(path), device="cpu")
    assert not marker.exists()
    # the control: what mmengine builds from that text
    MODELS.build(Config.fromstring(text, file_format=".py").model)
    assert marker.exists()


def test_the_inferencer_with_its_config_runs_on_the_weights(model, tmp_path):
    from mmdet.apis import DetInferencer
    from mmengine.config import Config

    path = tmp_path / "det.pth"
    pretty = Config.fromfile(TOY).pretty_text
    torch.save(dict(state_dict=model.state_dict(), meta=dict(cfg=pretty),
                    message_hub=dict(log_scalars={}, runtime_info=dict(cfg=pretty), resumed_keys={})), path)
    inferencer = DetInferencer(model=TOY, weights=str(path), device="cpu")
    assert type(inferencer.model.backbone).__name__ == "SwinBackbone"
    torch.testing.assert_close(inferencer.model.state_dict()["backbone.patch_embed.proj.weight"],
                               model.state_dict()["backbone.patch_embed.proj.weight"])
    image = np.random.RandomState(0).randint(0, 255, (96, 128, 3), dtype=np.uint8)
    assert len(inferencer(image, return_datasamples=False, no_save_vis=True)["predictions"]) == 1
