"""Swin V2 at its pretraining size gives its source model's features with no setting (issue #36):
``SwinV2Backbone`` with its defaults (or a published name's), loaded with timm's, torchvision's
and transformers' V2 models' weights, against those models at their pretraining sizes (256 with
window 8, 256 with window 16, 384 with the window-24 fine-tune), every stage, 1e-4. Stage 4's map
there is not larger than the window: Swin V2's own rule (window shrunk to the map, no shift) is
the default; an explicit ``pad_small_map=True`` (mmdet's rule) differs there and says so once at
load. Small widths and depths (16 channels, two blocks a stage): the windows and sizes are the
published ones."""
import warnings

import pytest
import torch

from swin_backbone import SwinV2Backbone, load_checkpoint
from swin_backbone.features import FeatureExtractor

from ..helpers import randomize, timm_stages

ATOL = 1e-4
SMALL = dict(embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4))
pytestmark = pytest.mark.usefixtures("one_thread")

#: (published name, image size): window 8 at 256, window 16 at 256, the 12to24 fine-tune at 384.
PUBLISHED = [("swinv2_tiny_window8_256", 256), ("swinv2_tiny_window16_256", 256),
             ("swinv2_base_window12to24_192to384", 384)]


def _ours(name=None, **kw):
    """SwinV2Backbone of a published name (its window and pre-training windows) at small widths,
    with random output norms (a classifier's file has only the final one)."""
    model = SwinV2Backbone(name, **SMALL, drop_path_rate=0.0, **kw).eval() if name else \
        SwinV2Backbone(arch=None, **SMALL, drop_path_rate=0.0, **kw).eval()
    with torch.no_grad():
        for i in range(4):
            getattr(model, f"norm{i}").weight.normal_(1.0, 0.2)
            getattr(model, f"norm{i}").bias.normal_(std=0.1)
    return model


def _load_quietly(model, state):
    """Load; any warning fails (the defaults must not need one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_checkpoint(model, state, logger=None)


def _assert_stages(ours, stage_maps, x, last_norm=None):
    """Our features of ``x`` against the reference's stage maps ``(B, H, W, C)``: stages 1-3
    through our output norms, stage 4 through ``last_norm`` (the reference's final norm, which
    our ``norm3`` loaded) or ours."""
    with torch.no_grad():
        got = ours(x)
    assert len(got) == len(stage_maps) == 4
    for i, (g, e) in enumerate(zip(got, stage_maps)):
        norm = last_norm if (i == 3 and last_norm is not None) else getattr(ours, f"norm{i}")
        torch.testing.assert_close(g, norm(e).permute(0, 3, 1, 2), rtol=ATOL, atol=ATOL,
                                   msg=lambda m: f"stage {i + 1}: {m}")


# ---------------------------------------------------------------- timm
@pytest.mark.parametrize("name,size", PUBLISHED, ids=[n for n, _ in PUBLISHED])
def test_timm_published_models_every_stage_at_their_size(name, size):
    timm = pytest.importorskip("timm")
    ref = randomize(timm.create_model(name, pretrained=False, embed_dim=16, depths=(2, 2, 2, 2),
                                      num_heads=(1, 2, 2, 4), drop_path_rate=0.0))
    assert ref.patch_embed.img_size == (size, size)
    ours = _ours(name)
    assert not ours.pad_small_map  # Swin V2's rule by default
    report = _load_quietly(ours, ref.state_dict())
    assert report.format == "timm-v2" and not report.unexpected and not report.mismatched
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        maps = timm_stages(ref, x)
    assert maps[3].shape[1] <= max(ours.window_sizes)  # stage 4: the map is not larger than the window
    _assert_stages(ours, maps, x, ref.norm)


def test_explicit_pad_small_map_differs_at_stage_4_and_says_so_once():
    timm = pytest.importorskip("timm")
    ref = randomize(timm.create_model("swinv2_tiny_window8_256", pretrained=False, embed_dim=16,
                                      depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)))
    ours = _ours(window_size=8, pad_small_map=True)
    with pytest.warns(UserWarning, match=r"SwinV2Backbone\(pad_small_map=True\) with checkpoint <dict> "
                                         r"\(format 'timm-v2'\).*shrinks to it and the shift is off.*"
                                         r"pad_small_map=False \(SwinV2Backbone's default\) gives them"):
        load_checkpoint(ours, ref.state_dict(), logger=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model: a second load says nothing
        load_checkpoint(ours, ref.state_dict(), logger=None)
    default = _ours(window_size=8)
    _load_quietly(default, ref.state_dict())
    default.load_state_dict(ours.state_dict())  # the same weights, output norms included
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        padded, shrunk = ours(x), default(x)
    for i in range(3):  # maps 64, 32, 16 > window 8: the rules agree
        torch.testing.assert_close(padded[i], shrunk[i], rtol=ATOL, atol=ATOL)
    assert (padded[3] - shrunk[3]).abs().max() > 1e-2  # map 8 = window: shifted (ours) vs not (V2's rule)
    # our own V2 files carry no source model's rule: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checkpoint(_ours(window_size=8, pad_small_map=True), default.state_dict(), logger=None)


def test_feature_extractor_v2_presets_give_the_source_features():
    timm = pytest.importorskip("timm")
    ref = randomize(timm.create_model("swinv2_tiny_window16_256", pretrained=False, embed_dim=16,
                                      depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)))
    fx = FeatureExtractor.from_arch("swinv2_tiny_window16_256", ref.state_dict(), **SMALL, stages=[3],
                                    mean=(0, 0, 0), std=(255, 255, 255))
    assert not fx.backbone.pad_small_map and fx.backbone.pretrained_window_sizes == (16, 16, 16, 8)
    assert not FeatureExtractor.from_arch("v2-tiny", **SMALL, seed=0).backbone.pad_small_map
    image = torch.rand(3, 256, 256) * 255
    (got,) = fx([image])
    with torch.no_grad():
        want = ref.norm(timm_stages(ref, image[None] / 255)[3]).permute(0, 3, 1, 2)[0]
    torch.testing.assert_close(got[3], want, rtol=ATOL, atol=ATOL)


# ---------------------------------------------------------------- torchvision
def test_torchvision_v2_window8_at_256_every_stage():
    pytest.importorskip("torchvision")
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    ref = randomize(SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4],
                                    window_size=[8, 8], stochastic_depth_prob=0.0, block=SwinTransformerBlockV2,
                                    downsample_layer=PatchMergingV2))
    with torch.no_grad():  # torchvision zeroes the k slice of qkv.bias in every forward; its files have zeros
        for name, p in ref.named_parameters():
            if name.endswith("attn.qkv.bias"):
                p[p.numel() // 3: 2 * p.numel() // 3] = 0
    ours = _ours("swinv2_tiny_window8_256")
    assert _load_quietly(ours, ref.state_dict()).format == "torchvision-v2"
    x = torch.randn(1, 3, 256, 256)
    maps, y = [], x
    with torch.no_grad():
        for k, feature in enumerate(ref.features):
            y = feature(y)
            if k % 2 == 1:
                maps.append(y)
    _assert_stages(ours, maps, x, ref.norm)


# ---------------------------------------------------------------- transformers
HF = [(dict(window_size=8, image_size=256), "swinv2_tiny_window8_256"),
      (dict(window_size=16, image_size=256), "swinv2_tiny_window16_256"),
      (dict(window_size=24, image_size=384, pretrained_window_sizes=[12, 12, 12, 6]),
       "swinv2_base_window12to24_192to384")]


@pytest.mark.parametrize("config,name", HF, ids=[n for _, n in HF])
def test_transformers_swinv2_backbone_every_stage_at_its_size(config, name):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.Swinv2Config(embed_dim=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], drop_path_rate=0.0,
                                    out_features=["stage1", "stage2", "stage3", "stage4"], **config)
    ref = randomize(transformers.Swinv2Backbone(cfg), std=0.2, position_mlp="continuous_position_bias_mlp.2.weight")
    ours = _ours(name)
    assert _load_quietly(ours, ref.state_dict()).format == "hf-v2"
    x = torch.randn(1, 3, config["image_size"], config["image_size"])
    with torch.no_grad():  # transformers' Swinv2Backbone has no output norms: ours (random) on its maps
        maps = [m.permute(0, 2, 3, 1) for m in ref(x).feature_maps]
    _assert_stages(ours, maps, x)
