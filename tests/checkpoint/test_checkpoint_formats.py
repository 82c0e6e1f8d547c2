"""Every checkpoint format round-trips: build the source model from its library with random
weights, save its checkpoint, load it into SwinBackbone, compare features (1e-4)."""
import re

import pytest
import torch

from swin_backbone import CheckpointError, SwinBackbone, load_checkpoint
from swin_backbone.checkpoint import detect_format, unwrap_state_dict
from swin_backbone.checkpoint.base import FROM_OURS

from ..helpers import randomize as _randomize

ATOL = 1e-4


def _save(tmp_path, obj, name="ckpt.pth"):
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


def _nchw(x):
    return x.permute(0, 3, 1, 2)


# ---------------------------------------------------------------- torchvision
def test_torchvision_round_trip(tmp_path):
    from torchvision.models import swin_t

    ref = _randomize(swin_t(weights=None))
    path = _save(tmp_path, ref.state_dict())
    ours = SwinBackbone("tiny", out_indices=(3,), pad_small_map=False, mask_padding=False).eval()
    report = load_checkpoint(ours, path)
    assert report.format == "torchvision"
    assert report.complete, report.summary()
    assert "head.weight" in report.skipped
    x = torch.randn(2, 3, 256, 320)  # stage maps 64x80 .. 8x10: window padding and shifts everywhere
    with torch.no_grad():
        expected = _nchw(ref.norm(ref.features(x)))
        (got,) = ours(x)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------- timm and official
def _timm_model():
    timm = pytest.importorskip("timm")
    return _randomize(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=10))


def timm_to_official(state):
    """timm keys -> official microsoft/Swin-Transformer keys (both use the official channel order)."""
    out = {}
    for key, value in state.items():
        new = re.sub(r"^layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m.group(1)) - 1}.downsample.", key)
        new = new.replace("head.fc.", "head.")
        out[new] = value
    return out


@pytest.mark.parametrize("fmt", ["timm", "official"])
def test_timm_and_official_round_trip(tmp_path, fmt):
    ref = _timm_model()
    state = ref.state_dict()
    if fmt == "official":
        state = timm_to_official(state)
        assert any(k.startswith("layers.0.downsample.") for k in state)
        checkpoint = {"model": state}  # the official repo wraps in 'model'
    else:
        checkpoint = state
    path = _save(tmp_path, checkpoint)
    ours = SwinBackbone("tiny", out_indices=(3,), pad_small_map=False).eval()
    report = load_checkpoint(ours, path)
    assert report.format == fmt
    assert report.complete, report.summary()
    # the classification model's final norm becomes the last stage's output norm
    assert "norm3.weight" in report.converted
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = _nchw(ref.forward_features(x))
        (got,) = ours(x)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------- mmdet / official detection / ours
def _mmdet_model():
    from mmdet.models.backbones import SwinTransformer

    ref = SwinTransformer(drop_path_rate=0.0, depths=(2, 2, 2, 2))
    ref.init_weights()
    return _randomize(ref)


@pytest.mark.parametrize("layout", ["mmdet", "official-detection", "ours", "ddp-wrapped-detector"])
def test_detection_layouts_round_trip(tmp_path, layout):
    ref = _mmdet_model()
    base = SwinBackbone(arch=None, embed_dims=96, depths=(2, 2, 2, 2), num_heads=(3, 6, 12, 24), mask_padding=False)
    load_checkpoint(base, ref.state_dict(), strict=True)
    if layout == "mmdet":
        checkpoint = {"state_dict": {"backbone." + k: v for k, v in ref.state_dict().items()}, "meta": {}}
    elif layout == "official-detection":
        official = FROM_OURS["official"](base.state_dict())
        checkpoint = {"state_dict": {"backbone." + k: v for k, v in official.items()}}
        checkpoint["state_dict"]["neck.lateral_convs.0.conv.weight"] = torch.zeros(1)
    elif layout == "ours":
        checkpoint = base.state_dict()
    else:
        checkpoint = {"state_dict": {"module.backbone." + k: v for k, v in ref.state_dict().items()}}
    path = _save(tmp_path, checkpoint)
    ours = SwinBackbone(arch=None, embed_dims=96, depths=(2, 2, 2, 2), num_heads=(3, 6, 12, 24), mask_padding=False).eval()
    report = load_checkpoint(ours, path, strict=True)
    expected_format = {"official-detection": "official", "ddp-wrapped-detector": "mmdet"}.get(layout, layout)
    assert report.format == expected_format
    x = torch.randn(1, 3, 75, 91)
    with torch.no_grad():
        for e, g in zip(ref(x), ours(x)):
            torch.testing.assert_close(g, e, rtol=ATOL, atol=ATOL)


def test_ours_to_mmdet_conversion_loads_into_mmdet(tmp_path):
    ref = _mmdet_model()
    ours = SwinBackbone(arch=None, embed_dims=96, depths=(2, 2, 2, 2), num_heads=(3, 6, 12, 24), mask_padding=False)
    load_checkpoint(ours, ref.state_dict(), strict=True)
    from mmdet.models.backbones import SwinTransformer

    back = SwinTransformer(drop_path_rate=0.0, depths=(2, 2, 2, 2))
    missing, unexpected = back.load_state_dict(FROM_OURS["mmdet"](ours.state_dict()), strict=False)
    assert not unexpected and all("relative_position_index" in k for k in missing)
    for a, b in zip(ref.state_dict().values(), back.state_dict().values()):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- resizing
def test_window7_checkpoint_into_window12_model(tmp_path):
    src = SwinBackbone("tiny", window_size=7)
    src.init_weights()
    path = _save(tmp_path, {"state_dict": src.state_dict()})
    dst = SwinBackbone("tiny", window_size=12).eval()
    report = load_checkpoint(dst, path)
    tables = [k for k in report.resized if k.endswith("relative_position_bias_table")]
    assert len(tables) == 12 and report.complete
    assert dst.stages[0].blocks[0].attn.relative_position_bias_table.shape == (23 * 23, 3)
    with torch.no_grad():
        outs = dst(torch.randn(1, 3, 100, 130))
    assert all(torch.isfinite(o).all() for o in outs)


def test_resized_table_keeps_centre_and_is_smooth():
    from swin_backbone.checkpoint.resize import resize_relative_position_bias_table

    table = torch.ones(13 * 13, 2) * torch.tensor([1.0, -2.0])
    out = resize_relative_position_bias_table(table, 12)
    assert out.shape == (23 * 23, 2)
    torch.testing.assert_close(out, torch.ones(23 * 23, 2) * torch.tensor([1.0, -2.0]))
    rect = resize_relative_position_bias_table(table, (5, 9))  # non-square target
    assert rect.shape == (9 * 17, 2)


def test_abs_pos_embed_and_in_channels_adapted():
    src = SwinBackbone(**dict(arch=None, embed_dims=32, depths=(2, 2), num_heads=(2, 4)), use_abs_pos_embed=True,
                       pretrain_img_size=224, out_indices=(0, 1))
    src.init_weights()
    state = src.state_dict()
    state["absolute_pos_embed"] = state["absolute_pos_embed"].flatten(2).transpose(1, 2)  # mmdet's (1, L, C)
    dst = SwinBackbone(**dict(arch=None, embed_dims=32, depths=(2, 2), num_heads=(2, 4)), use_abs_pos_embed=True,
                       pretrain_img_size=384, in_channels=1, out_indices=(0, 1))
    report = load_checkpoint(dst, state)
    assert set(report.resized) == {"absolute_pos_embed", "patch_embed.proj.weight"}
    assert dst.absolute_pos_embed.shape == (1, 32, 96, 96)
    torch.testing.assert_close(dst.patch_embed.proj.weight, src.patch_embed.proj.weight.sum(1, keepdim=True))
    dst.eval()(torch.randn(1, 1, 50, 70))  # and runs at another size, resizing per forward


# ---------------------------------------------------------------- a model built on the meta device
def test_a_model_built_without_values_loads_as_one_built_normally(tmp_path):
    # Built under torch.device('meta') (no initialisation, no memory), the model takes the
    # checkpoint's tensors: converted (the official layout), resized (window 7 -> 12), in its
    # own dtype (an fp16 file), copies (never the caller's tensors); init_cfg's Pretrained too.
    src = _randomize(SwinBackbone("tiny", window_size=7))
    official = FROM_OURS["official"](src.state_dict())
    path = _save(tmp_path, {"model": {k: v.half() for k, v in official.items()}})
    expected = SwinBackbone("tiny", window_size=12).eval()
    load_checkpoint(expected, path)
    with torch.device("meta"):
        built = {"load_checkpoint": SwinBackbone("tiny", window_size=12),
                 "init_cfg": SwinBackbone("tiny", window_size=12, init_cfg=dict(type="Pretrained", checkpoint=path))}
    report = load_checkpoint(built["load_checkpoint"], path)
    assert report.format == "official" and len(report.resized) == 12
    built["init_cfg"].init_weights()
    x = torch.randn(1, 3, 100, 130)
    for name, model in built.items():
        assert {(t.device.type, t.dtype) for t in model.state_dict().values()} == {("cpu", torch.float32)}, name
        with torch.no_grad():
            for got, want in zip(model.eval()(x), expected(x)):
                assert torch.equal(got, want), name
    # a dict's tensors are copied: training the loaded model leaves the source model as it was
    with torch.device("meta"):
        model = SwinBackbone("tiny", window_size=7)
    load_checkpoint(model, src.state_dict())
    assert not {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in src.parameters()}
    # what the checkpoint does not give stays on meta, and the warning names it
    with torch.device("meta"):
        model = SwinBackbone("tiny", window_size=7)
    partial = {k: v for k, v in src.state_dict().items() if not k.startswith("norm3.")}
    with pytest.warns(UserWarning, match=r"gave no value to 2 tensor.*meta.*'norm3\.weight', 'norm3\.bias'"):
        report = load_checkpoint(model, partial)
    assert report.missing == ["norm3.weight", "norm3.bias"] and model.norm3.weight.is_meta
    assert not model.norm2.weight.is_meta


# ---------------------------------------------------------------- reports and errors
def test_partial_load_is_reported_by_key():
    small = SwinBackbone("small", out_indices=(3,))
    tiny = SwinBackbone("tiny", out_indices=(3,))
    report = load_checkpoint(tiny, small.state_dict())
    assert not report.missing
    assert any(k.startswith("stages.2.blocks.17.") for k in report.unexpected)
    assert "unexpected" in report.summary()
    with pytest.raises(CheckpointError, match="strict"):
        load_checkpoint(tiny, small.state_dict(), strict=True)


def test_wrong_architecture_is_an_error():
    base = SwinBackbone("base")
    tiny = SwinBackbone("tiny")
    with pytest.raises(CheckpointError, match=r"format 'ours'.*only \d+ of the model's"):
        load_checkpoint(tiny, base.state_dict())


def test_non_swin_checkpoint_is_an_error(tmp_path):
    from torchvision.models import resnet18

    path = _save(tmp_path, resnet18(weights=None).state_dict())
    with pytest.raises(CheckpointError, match="not a Swin Transformer checkpoint.*conv1.weight"):
        load_checkpoint(SwinBackbone("tiny"), path)


def test_bad_files_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # (the URL case below: an empty cache)
    model = SwinBackbone("tiny")
    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_checkpoint(model, str(empty))
    good = _save(tmp_path, model.state_dict(), "good.pth")
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt, truncated"):
        load_checkpoint(model, str(truncated))
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"\x00not a checkpoint" * 100)
    with pytest.raises(CheckpointError, match="garbage.pth.*expected a torch checkpoint.*found binary data"):
        load_checkpoint(model, str(garbage))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_checkpoint(model, str(tmp_path / "missing.pth"))
    # A URL is fetched as mmengine does (tests/checkpoint/test_checkpoint_urls.py); one that cannot
    # be reached is an error naming it (a closed loopback port: never outside this machine).
    with pytest.raises(CheckpointError, match="checkpoint 'http://127.0.0.1:9/swin.pth': cannot reach"):
        load_checkpoint(model, "http://127.0.0.1:9/swin.pth")
    with pytest.raises(CheckpointError, match="no tensors"):
        load_checkpoint(model, {"meta": {"epoch": 3}})


def test_detect_format_names():
    assert detect_format(["features.1.0.attn.qkv.weight"]) == "torchvision"
    assert detect_format(["stages.0.blocks.0.attn.w_msa.qkv.weight"]) == "mmdet"
    assert detect_format(["layers.0.blocks.0.attn.qkv.weight", "layers.0.downsample.reduction.weight"]) == "official"
    assert detect_format(["layers.0.blocks.0.attn.qkv.weight", "layers.1.downsample.reduction.weight"]) == "timm"
    assert detect_format(["stages.0.blocks.0.attn.qkv.weight"]) == "ours"
    assert detect_format(["conv1.weight"]) == "unknown"
    state, steps = unwrap_state_dict({"state_dict": {"module.backbone.a": torch.zeros(1), "module.neck.b": torch.zeros(1)}})
    assert list(state) == ["a"] and len(steps) == 3


def test_every_format_module_registers_its_layouts():
    # checkpoint.detect imports the three format modules (V1, V2, transformers); each registers
    # into checkpoint.base, in this order
    from swin_backbone.checkpoint import FORMATS
    from swin_backbone.checkpoint.base import V2_FROM_OURS

    assert FORMATS == ("ours", "official", "mmdet", "timm", "torchvision", "ours-v2", "official-v2",
                       "mmpretrain-v2", "timm-v2", "torchvision-v2", "hf", "hf-v2")
    assert sorted(FROM_OURS) == ["hf", "mmdet", "official", "ours"]
    assert sorted(V2_FROM_OURS) == ["hf", "mmpretrain", "official", "ours", "timm", "torchvision"]


def test_whole_model_load_reports_leftovers_through_torch():
    # Through the state-dict pre-hook (load_from / --resume path), keys the backbone lacks are
    # not dropped silently: torch lists them, already converted to our names.
    from swin_backbone.checkpoint.base import FROM_OURS

    class Detector(torch.nn.Module):
        def __init__(self, arch):
            super().__init__()
            self.backbone = SwinBackbone(arch, out_indices=(3,))

    small = FROM_OURS["mmdet"](SwinBackbone("small", out_indices=(3,)).state_dict())
    result = Detector("tiny").load_state_dict({"backbone." + k: v for k, v in small.items()}, strict=False)
    assert not result.missing_keys
    assert "backbone.stages.2.blocks.17.mlp.fc1.weight" in result.unexpected_keys
    with pytest.raises(RuntimeError, match="Unexpected key"):
        Detector("tiny").load_state_dict({"backbone." + k: v for k, v in small.items()}, strict=True)
