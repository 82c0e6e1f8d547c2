"""Swin V2 checkpoint formats: detection, every layout from ours and back, into the real
timm / torchvision models, and the conversion tool."""
import pytest
import torch

from swin_backbone import SwinV2Backbone, load_checkpoint
from swin_backbone.checkpoint import detect_format
from swin_backbone.checkpoint.base import V2_FROM_OURS
from swin_backbone.checkpoint.formats import official_to_unfold
from swin_backbone.tools.convert_checkpoint import main as convert_main

from ..helpers import TINY as SMALL
from ..helpers import randomize as _randomize
from ..helpers import timm_stages as _timm_stages

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kw):
    model = SwinV2Backbone(**dict(SMALL, **kw)).eval()
    model.init_weights()
    return _randomize(model)


@pytest.mark.parametrize("fmt", sorted(V2_FROM_OURS))
def test_every_v2_layout_round_trips(fmt):
    src = _model(out_indices=(3,))  # classification layouts hold one (final) norm
    state = V2_FROM_OURS[fmt](src.state_dict())
    assert detect_format(state) == f"{fmt}-v2"
    dst = SwinV2Backbone(**dict(SMALL, out_indices=(3,))).eval()
    report = load_checkpoint(dst, state, strict=True, logger=None)
    assert report.format == f"{fmt}-v2"
    for key, value in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_mmpretrain_layout_reorders_the_reduction_only():
    src = _model()
    state = V2_FROM_OURS["mmpretrain"](src.state_dict())
    # merging at the start of the next stage; Unfold order for the reduction's inputs
    reduction = src.state_dict()["stages.0.downsample.reduction.weight"]
    assert torch.equal(state["stages.1.downsample.reduction.weight"], official_to_unfold(reduction))
    # the V2 merge norm is over the 2C outputs: no channel order to convert
    assert torch.equal(state["stages.1.downsample.norm.weight"], src.state_dict()["stages.0.downsample.norm.weight"])
    assert "stages.0.blocks.0.attn.w_msa.cpb_mlp.0.weight" in state
    assert "stages.0.blocks.0.ffn.layers.0.0.weight" in state


def test_torchvision_and_timm_layouts_load_into_the_real_models():
    from torchvision.models import swin_v2_t

    timm = pytest.importorskip("timm")
    ours = SwinV2Backbone("tiny", out_indices=(3,), pad_small_map=False, mask_padding=False).eval()
    ours.init_weights()
    _randomize(ours)
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        (expected,) = ours(x)
    tv = swin_v2_t(weights=None).eval()
    missing, unexpected = tv.load_state_dict(V2_FROM_OURS["torchvision"](ours.state_dict()), strict=False)
    assert not unexpected
    assert all(k.startswith("head.") or k.endswith(("relative_coords_table", "relative_position_index")) for k in missing)
    ref = timm.create_model("swinv2_tiny_window8_256", pretrained=False).eval()
    missing, unexpected = ref.load_state_dict(V2_FROM_OURS["timm"](ours.state_dict()), strict=False)
    assert not unexpected and all(k.startswith("head.") for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(tv.norm(tv.features(x)).permute(0, 3, 1, 2), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ref.norm(_timm_stages(ref, x)[-1]).permute(0, 3, 1, 2), expected,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("to", ["torchvision", "mmpretrain", "official", "ours"])
def test_convert_tool_v2(tmp_path, to, capsys):
    timm = pytest.importorskip("timm")
    ref = _randomize(timm.create_model("swinv2_tiny_window8_256", pretrained=False, embed_dim=16,
                                       num_heads=(1, 2, 2, 4), depths=(2, 2, 2, 2)))
    src, dst = tmp_path / "timm.pth", tmp_path / "out.pth"
    torch.save(ref.state_dict(), src)
    assert convert_main([str(src), str(dst), "--to", to, "--strict"]) == 0
    assert "format 'timm-v2'" in capsys.readouterr().out
    out = torch.load(dst, weights_only=True)
    assert out["meta"]["source_format"] == "timm-v2"
    assert detect_format(out["state_dict"]) == f"{to}-v2"
    a = SwinV2Backbone(**dict(SMALL, out_indices=(3,))).eval()
    b = SwinV2Backbone(**dict(SMALL, out_indices=(3,))).eval()
    load_checkpoint(a, ref.state_dict(), strict=True, logger=None)
    load_checkpoint(b, out["state_dict"], strict=True, logger=None)
    for key, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], value), key


def test_convert_tool_refuses_v2_only_targets_for_v1(tmp_path, capsys):
    from swin_backbone import SwinBackbone

    src = tmp_path / "v1.pth"
    torch.save(SwinBackbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), out_indices=(1,)).state_dict(), src)
    assert convert_main([str(src), str(tmp_path / "out.pth"), "--to", "torchvision"]) == 1
    err = capsys.readouterr().err
    assert "to: expected one of ['hf', 'mmdet', 'official', 'ours'] for a Swin V1 checkpoint" in err
    assert not (tmp_path / "out.pth").exists()
