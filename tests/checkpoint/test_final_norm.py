"""A classification checkpoint's final norm (``norm.*``): ``load_checkpoint`` makes it the last
stage's output norm (the source model's features); ``init_cfg`` ``Pretrained`` loads the
layouts mmdet / mmseg read themselves as they do (their SwinTransformer never loads it), and
other layouts as ``load_checkpoint`` (tests/checkpoint/test_stock_config_weights.py compares
with the libraries themselves)."""
import re

import pytest
import torch

from swin_backbone import SwinBackbone, load_checkpoint
from swin_backbone.checkpoint.base import FROM_OURS

from ..helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


def _classifier_file(tmp_path, layout):
    """A random Swin as a classifier's file of ``layout``: the last stage's norm as ``norm.*``,
    no other output norms."""
    src = SwinBackbone(**TINY).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(std=0.2)
    state = {}
    for key, value in FROM_OURS[layout](src.state_dict()).items():
        if re.fullmatch(r"norm\d\.(weight|bias)", key):
            if key.startswith("norm3."):
                state["norm." + key.split(".")[1]] = value
            continue
        state[key] = value
    path = tmp_path / f"{layout}.pth"
    torch.save({"model": state}, path)
    return src, str(path)


@pytest.mark.parametrize("layout", ["official", "mmdet"])
def test_init_cfg_leaves_the_classifiers_final_norm_out_as_mmdet_does(tmp_path, layout):
    src, path = _classifier_file(tmp_path, layout)
    direct = SwinBackbone(**TINY)
    report = load_checkpoint(direct, path, logger=None)
    assert report.converted["norm3.weight"].startswith("renamed from norm.weight")
    torch.testing.assert_close(direct.norm3.weight, src.norm3.weight, rtol=0, atol=0)

    via_init = SwinBackbone(**TINY, init_cfg=dict(type="Pretrained", checkpoint=path))
    built = via_init.norm3.weight.detach().clone()
    via_init.init_weights()
    torch.testing.assert_close(via_init.norm3.weight, built, rtol=0, atol=0)  # as built, as mmdet's
    torch.testing.assert_close(via_init.stages[3].blocks[1].mlp.fc2.weight, src.stages[3].blocks[1].mlp.fc2.weight,
                               rtol=0, atol=0)  # everything else loaded
    skipped = load_checkpoint(SwinBackbone(**TINY), path, logger=None, final_norm=False).skipped
    assert "mmdet's / mmseg's SwinTransformer do not load it into norm3" in skipped["norm.weight"]


def test_init_cfg_keeps_the_final_norm_of_layouts_the_libraries_cannot_read(tmp_path):
    pytest.importorskip("torchvision")
    from torchvision.models.swin_transformer import SwinTransformer

    tv = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4],
                         window_size=[7, 7])
    torch.nn.init.normal_(tv.norm.weight)
    path = tmp_path / "tv.pth"
    torch.save(tv.state_dict(), path)
    model = SwinBackbone(**TINY, init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    model.init_weights()
    torch.testing.assert_close(model.norm3.weight, tv.norm.weight, rtol=0, atol=0)
