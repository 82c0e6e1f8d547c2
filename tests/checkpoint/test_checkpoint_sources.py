"""Checkpoint sources beyond the layouts: safetensors files for every format (by path, in
init_cfg, in the converter), legacy mmcls files (final ``norm``, ``attn_mask`` buffers) and
torchvision V2 files with a non-zero k slice in ``qkv.bias``."""
import pytest
import torch

from swin_backbone import SwinBackbone, SwinV2Backbone, load_checkpoint
from swin_backbone.checkpoint import read_checkpoint, write_checkpoint
from swin_backbone.checkpoint.base import FROM_OURS, V2_FROM_OURS

from ..helpers import TINY as V1

ATOL = 1e-4
V2 = dict(V1, window_size=8)
pytestmark = pytest.mark.usefixtures("one_thread")


def _random(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
    return model.eval()


def _save_file(path, state):
    save_file = pytest.importorskip("safetensors.torch").save_file
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(path))
    return str(path)


# ---------------------------------------------------------------- safetensors
@pytest.mark.parametrize("layout", sorted(FROM_OURS) + [f"{k}-v2" for k in sorted(V2_FROM_OURS)])
def test_safetensors_file_of_every_layout_loads_by_path(tmp_path, layout):
    v2 = layout.endswith("-v2")
    src = _random(SwinV2Backbone(**dict(V2, out_indices=(3,))) if v2 else SwinBackbone(**dict(V1, out_indices=(3,))))
    convert = V2_FROM_OURS[layout[:-3]] if v2 else FROM_OURS[layout]
    path = _save_file(tmp_path / "weights.safetensors", convert(src.state_dict()))
    dst = (SwinV2Backbone(**dict(V2, out_indices=(3,))) if v2 else SwinBackbone(**dict(V1, out_indices=(3,))))
    report = load_checkpoint(dst, path, strict=True, logger=None)
    assert report.format == layout
    for key, value in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_safetensors_in_init_cfg(tmp_path):
    src = _random(SwinBackbone(**V1))
    path = _save_file(tmp_path / "swin.safetensors", src.state_dict())
    model = SwinBackbone(**V1, init_cfg=dict(type="Pretrained", checkpoint=path))
    model.init_weights()
    for key, value in src.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_safetensors_are_read_without_pickle(tmp_path):
    """A safetensors file is parsed by the safetensors library: torch.load is never called."""
    path = _save_file(tmp_path / "w.safetensors", {"stages.0.blocks.0.attn.qkv.weight": torch.ones(3, 1)})
    real_load = torch.load
    try:
        torch.load = lambda *a, **k: pytest.fail("torch.load called for a safetensors file")
        state = read_checkpoint(path)
    finally:
        torch.load = real_load
    assert list(state) == ["stages.0.blocks.0.attn.qkv.weight"]


def test_failed_write_leaves_no_file(tmp_path):
    pytest.importorskip("safetensors")
    with pytest.raises(Exception):
        write_checkpoint(str(tmp_path / "out.safetensors"), {"a": "not a tensor"})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- legacy mmcls
def test_legacy_mmcls_final_norm_and_attn_mask(tmp_path):
    """A state-dict version 1 file made the way mmpretrain's own test makes one: the last
    stage's norm renamed to ``norm`` and an ``attn_mask`` buffer in a shifted block."""
    backbones = pytest.importorskip("mmdet.models.backbones")
    from mmengine.runner.checkpoint import get_state_dict, save_checkpoint

    ref = backbones.SwinTransformer(embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), out_indices=(3,),
                                    drop_path_rate=0.0)
    _random(ref)  # (mmdet's train() returns None: no chaining)
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        (expected,) = ref(x)
    setattr(ref, "norm", ref.norm3)
    ref.stages[0].blocks[1].attn.register_buffer("attn_mask", torch.zeros(64, 49, 49))  # mmcls 0.x kept it
    ref._version = 1
    del ref.norm3
    state = get_state_dict(ref)
    assert "norm.weight" in state and "stages.0.blocks.1.attn.attn_mask" in state
    assert state._metadata[""]["version"] == 1
    path = tmp_path / "mmcls_v1.pth"
    save_checkpoint({"state_dict": state, "meta": {}}, str(path))

    ours = SwinBackbone(**dict(V1, out_indices=(3,)), mask_padding=False).eval()
    report = load_checkpoint(ours, str(path), strict=True, logger=None)  # failed before: norm.* unexpected
    assert report.format == "mmdet"
    assert "state-dict version < 2" in report.converted["norm3.weight"]
    assert report.skipped["stages.0.blocks.1.attn.attn_mask"] == "buffer, recomputed per input size"
    with torch.no_grad():
        (got,) = ours(x)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------- torchvision V2 k slice
def test_torchvision_v2_non_zero_k_bias_loads_as_torchvision_computes():
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    tv = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4],
                         window_size=[8, 8], stochastic_depth_prob=0.0, block=SwinTransformerBlockV2,
                         downsample_layer=PatchMergingV2)
    _random(tv)
    state = tv.state_dict()
    k_slice = state["features.1.0.attn.qkv.bias"][16:32]
    assert k_slice.abs().max() > 0  # torchvision zeroes it in every forward; the file keeps it
    ours = SwinV2Backbone(**dict(V2, out_indices=(3,)), pad_small_map=False, mask_padding=False).eval()
    report = load_checkpoint(ours, state, logger=None)
    assert report.format == "torchvision-v2"
    reason = report.skipped["features.1.0.attn.qkv.bias [k slice]"]
    assert "non-zero k bias" in reason and "torchvision zeroes" in reason
    assert "[k slice]" in report.summary()
    assert not report.unexpected and not report.mismatched
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        expected = tv.norm(tv.features(x)).permute(0, 3, 1, 2)
        (got,) = ours(x)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)
