"""Hugging Face transformers Swin / Swin V2 checkpoints: transformers' own models built from
their configs with random weights (no download), their feature maps against ours (1e-4), both
key generations (transformers 5's in-memory names, the files save_pretrained writes), heads
skipped with a reason, and the converter's ``--to hf`` read back by transformers."""
import pytest
import torch

from swin_backbone import SwinBackbone, SwinV2Backbone, load_checkpoint
from swin_backbone.tools.convert_checkpoint import convert_file

from ..helpers import TINY, randomize

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ATOL = 1e-4
STAGES = ["stage1", "stage2", "stage3", "stage4"]
HF_V1 = dict(embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=7, drop_path_rate=0.0)
OURS_V1 = TINY
HF_V2 = dict(embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], window_size=8, image_size=256,
             drop_path_rate=0.0)
OURS_V2 = dict(TINY, window_size=8, pad_small_map=False)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _randomize(model):
    """:func:`~tests.helpers.randomize` with transformers' V2 position-bias MLP name."""
    return randomize(model, std=0.2, position_mlp="continuous_position_bias_mlp.2.weight")


def _tokens_to_nchw(tokens, hw):
    return tokens.reshape(tokens.shape[0], hw[0], hw[1], -1).permute(0, 3, 1, 2)


def _saved_keys(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


# ---------------------------------------------------------------- V1
@pytest.mark.parametrize("generation", ["in-memory", "saved"])
def test_v1_swin_backbone_parity_both_key_generations(tmp_path, generation):
    ref = _randomize(transformers.SwinBackbone(transformers.SwinConfig(**HF_V1, out_features=STAGES)))
    if generation == "in-memory":  # transformers 5 names, as a live model's state_dict has them
        checkpoint = ref.state_dict()
        assert any(".attention.q_proj." in k for k in checkpoint)
    else:  # what save_pretrained writes: transformers 4 names, in model.safetensors
        ref.save_pretrained(tmp_path)
        checkpoint = str(tmp_path / "model.safetensors")
        assert any(".attention.self.query." in k for k in _saved_keys(checkpoint))
    # transformers' SwinBackbone keeps window 7 and the shift on small maps and does not mask
    # the padding: ours with pad_small_map=True, mask_padding=False
    ours = SwinBackbone(**OURS_V1, mask_padding=False).eval()
    report = load_checkpoint(ours, checkpoint, strict=True, logger=None)
    assert report.format == "hf"
    assert report.complete, report.summary()
    assert "stages.0.blocks.0.attn.qkv.weight" in report.converted
    assert "norm0.weight" in report.converted  # hidden_states_norms.stage1
    assert "unused by its SwinBackbone" in report.skipped["swin.layernorm.weight"]
    x = torch.randn(2, 3, 75, 91)  # maps 19x23 .. 3x3: window padding and shifts in every stage
    with torch.no_grad():
        expected = ref(x).feature_maps
        got = ours(x)
    assert len(got) == len(expected) == 4
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=ATOL, atol=ATOL, msg=lambda m: f"stage {i}: {m}")


@pytest.mark.parametrize("prefix", ["", "model."])
def test_v1_image_classification_checkpoint(prefix):
    ref = _randomize(transformers.SwinForImageClassification(transformers.SwinConfig(**HF_V1, num_labels=5)))
    state = {prefix + k: v for k, v in ref.state_dict().items()}
    ours = SwinBackbone(**OURS_V1, out_indices=(3,), pad_small_map=False).eval()
    report = load_checkpoint(ours, state, strict=True, logger=None)
    assert report.format == "hf"
    assert report.skipped[prefix + "classifier.weight"] == "classification head (transformers)"
    assert report.converted["norm3.weight"] == f"renamed from {prefix}swin.layernorm.weight"
    x = torch.randn(1, 3, 224, 224)  # the last map is 7x7 = the window: transformers' SwinModel runs
    with torch.no_grad():
        expected = _tokens_to_nchw(ref.swin(x).last_hidden_state, (7, 7))
        (got,) = ours(x)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------- V2
def _v2_compare(ours, hf_maps, got):
    """Stage maps of transformers' Swinv2Backbone (no output norms) through our output norms."""
    for i, (g, e) in enumerate(zip(got, hf_maps)):
        norm = getattr(ours, f"norm{i}")
        expected = norm(e.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        torch.testing.assert_close(g, expected, rtol=ATOL, atol=ATOL, msg=lambda m: f"stage {i}: {m}")


def test_v2_backbone_parity():
    ref = _randomize(transformers.Swinv2Backbone(transformers.Swinv2Config(**HF_V2, out_features=STAGES)))
    ours = SwinV2Backbone(**OURS_V2).eval()
    with torch.no_grad():
        for i in range(4):  # output norms are ours (transformers' Swinv2Backbone has none): random
            getattr(ours, f"norm{i}").weight.normal_(1.0, 0.2)
    report = load_checkpoint(ours, ref.state_dict(), logger=None)
    assert report.format == "hf-v2"
    assert report.missing == [f"norm{i}.{p}" for i in range(4) for p in ("weight", "bias")]
    assert not report.unexpected and not report.mismatched
    assert "split" not in report.converted["stages.0.blocks.0.attn.q_bias"]
    x = torch.randn(1, 3, 256, 256)  # the model's image size: transformers fixes its windows by it
    with torch.no_grad():
        _v2_compare(ours, ref(x).feature_maps, ours(x))


def test_v2_image_classification_file(tmp_path):
    ref = _randomize(transformers.Swinv2ForImageClassification(transformers.Swinv2Config(**HF_V2, num_labels=3)))
    ref.save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    keys = _saved_keys(path)
    assert "swinv2.encoder.layers.0.blocks.0.attention.self.logit_scale" in keys
    assert not any(k.endswith("attention.self.key.bias") for k in keys)  # V2's key has no bias
    ours = SwinV2Backbone(**OURS_V2, out_indices=(3,)).eval()
    report = load_checkpoint(ours, path, strict=True, logger=None)
    assert report.format == "hf-v2"
    assert "classifier.weight" in report.skipped
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        expected = _tokens_to_nchw(ref.swinv2(x).last_hidden_state, (8, 8))
        (got,) = ours(x)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------- the converter writes hf
def _from_pretrained(cls, config, weights, folder):
    """transformers' own loader (its key conversions included) on a folder with our file."""
    folder.mkdir()
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(weights.read_bytes())
    model, info = cls.from_pretrained(str(folder), output_loading_info=True)
    return model.eval(), info


def test_convert_to_hf_v1_round_trip(tmp_path):
    src = _randomize(SwinBackbone(**OURS_V1, mask_padding=False))
    torch.save({"state_dict": src.state_dict()}, tmp_path / "ours.pth")
    dst = tmp_path / "hf.safetensors"
    report, meta = convert_file(str(tmp_path / "ours.pth"), str(dst), to="hf", strict=True)
    assert report.complete and meta["written"] > 0
    ref, info = _from_pretrained(transformers.SwinBackbone, transformers.SwinConfig(**HF_V1, out_features=STAGES),
                                 dst, tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = torch.randn(1, 3, 61, 80)
    with torch.no_grad():
        for g, e in zip(src.eval()(x), ref(x).feature_maps):
            torch.testing.assert_close(g, e, rtol=ATOL, atol=ATOL)
    back = SwinBackbone(**OURS_V1, mask_padding=False)
    assert load_checkpoint(back, str(dst), strict=True, logger=None).format == "hf"
    for key, value in src.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_convert_to_hf_v2_round_trip(tmp_path):
    src = _randomize(SwinV2Backbone(**OURS_V2, out_indices=(3,)))
    torch.save(src.state_dict(), tmp_path / "ours_v2.pth")
    dst = tmp_path / "hf_v2.pth"  # torch.save container this time
    convert_file(str(tmp_path / "ours_v2.pth"), str(dst), to="hf", strict=True)
    from safetensors.torch import save_file

    written = torch.load(dst, weights_only=True)
    assert written["meta"]["swin_backbone_format"] == "hf"
    save_file({k: v.clone() for k, v in written["state_dict"].items()}, str(tmp_path / "w.safetensors"))
    ref, info = _from_pretrained(transformers.Swinv2Model, transformers.Swinv2Config(**HF_V2),
                                 tmp_path / "w.safetensors", tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        (got,) = src.eval()(x)
        torch.testing.assert_close(got, _tokens_to_nchw(ref(x).last_hidden_state, (8, 8)), rtol=ATOL, atol=ATOL)
    back = SwinV2Backbone(**OURS_V2, out_indices=(3,))
    assert load_checkpoint(back, str(dst), strict=True, logger=None).format == "hf-v2"
    for key, value in src.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_v1_backbone_inside_a_transformers_segmentation_model():
    """UperNet with a Swin backbone (transformers' own): the backbone loads from the whole
    model's state dict, the heads are skipped by key."""
    swin = transformers.SwinConfig(**HF_V1, out_features=STAGES)
    ref = transformers.UperNetForSemanticSegmentation(
        transformers.UperNetConfig(backbone_config=swin, hidden_size=16, auxiliary_in_channels=64, num_labels=3))
    _randomize(ref)
    ours = SwinBackbone(**OURS_V1, mask_padding=False).eval()
    report = load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    assert report.format == "hf" and report.complete
    heads = [k for k in report.skipped if k.startswith(("decode_head.", "auxiliary_head."))]
    assert heads and len(heads) == len([k for k in ref.state_dict() if k.startswith(("decode_head.", "auxiliary_head."))])
    x = torch.randn(1, 3, 64, 80)
    with torch.no_grad():
        for g, e in zip(ours(x), ref.backbone(x).feature_maps):
            torch.testing.assert_close(g, e, rtol=ATOL, atol=ATOL)
