"""Drop-in use of mmdet / mmseg Swin configs (issue #17).

Every config shipped inside the installed mmdet and mmseg packages whose backbone is
``SwinTransformer`` builds :class:`SwinBackbone` when that one word becomes ``SwinBackbone``,
every other key of the backbone unchanged; with ``mask_padding=False`` and the library
model's weights it gives the library model's features. The configs are found at collection
time, so configs added by a new mmdet / mmseg release are covered without editing this file.
Nothing downloads: the configs' checkpoint URLs are only ever stored in ``init_cfg``, and
sockets refuse to connect during these tests.
"""
from __future__ import annotations

import copy
import os
import socket
import warnings

import pytest
import torch
from mmengine.config import Config
from torch import nn

import swin_backbone
from swin_backbone import SwinBackbone
from swin_backbone.model.dropin import PRETRAINED_DEPRECATION, translate_mmlab_args

from ..helpers import small_arch
from .library_configs import (CASES, CONFIG_PATHS, LIBS, ODD_SIZE, Case, assert_case_features, assert_same_features,
                              build, config_root, one_word_change, perturb)


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    """Any attempt to fetch a checkpoint URL fails the test instead of downloading."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"test tried to open a network connection to {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# ---------------------------------------------------------------- every shipped config
def test_discovery_finds_the_known_configs():
    counts = {lib: sum(p.startswith(lib + "/") for p in CONFIG_PATHS) for lib in LIBS}
    assert counts["mmdet"] >= 90 and counts["mmseg"] >= 20, counts
    for known in [
        "mmdet/swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py",  # names SwinTransformer
        "mmdet/swin/mask-rcnn_swin-s-p4-w7_fpn_amp-ms-crop-3x_coco.py",  # only inherits it
        "mmdet/mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco.py",
        "mmseg/swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py",
        "mmseg/maskformer/maskformer_swin-t_upernet_8xb2-160k_ade20k-512x512.py",
        "mmseg/mask2former/mask2former_swin-l-in22k-384x384-pre_8xb2-160k_ade20k-640x640.py",
    ]:
        assert known in CONFIG_PATHS


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_one_word_change_gives_library_features(case, one_thread):
    if case.error:
        pytest.fail(f"{case.id} does not load: {case.error}")
    # The one-word change (+ mask_padding=False for the library's numbers) builds; every other
    # key is the config's own, init_cfg / pretrained checkpoint URLs included: building only
    # records them (init_weights, which would load them, is not called; no_downloads checks).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PRETRAINED_DEPRECATION)
        ours = build(case.lib, dict(one_word_change(case.backbone), mask_padding=False))
        ref = build(case.lib, case.backbone)
    assert type(ours) is SwinBackbone
    expected_init = case.backbone.get("init_cfg")
    if case.backbone.get("pretrained"):
        expected_init = dict(type="Pretrained", checkpoint=case.backbone["pretrained"])
    assert ours.init_cfg == expected_init
    if not (case.lib == "mmdet" and case.backbone.get("pretrained")):  # mmdet 3.3 drops it
        assert ours.init_cfg == ref.init_cfg

    # With the library model's weights: the library model's features (eval mode, so the
    # configs' drop_path_rate, with_cp and dropout do nothing in either).
    ours.eval()
    ref.eval()  # (mmdet's train() returns None: no chaining)
    perturb(ref)
    report = swin_backbone.load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    assert report.format == "mmdet" and report.complete
    assert_case_features(case, ours, ref)


def _case(path: str) -> Case:
    return next(c for c in CASES if path in (f"{c.lib}/{p}" for p in c.paths))


def test_mask_padding_is_what_differs(one_thread):
    # The one-word change alone keeps mask_padding=True: identical where no window needs
    # padding (224 x 224: 56, 28, 14, 7 tokens, multiples of the window 7), different where
    # padding is added (real tokens no longer attend to padding).
    case = _case("mmdet/swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py")
    ref = build(case.lib, dict(case.backbone, init_cfg=None))
    ours = build(case.lib, dict(one_word_change(case.backbone), init_cfg=None)).eval()
    ref.eval()  # (mmdet's train() returns None: no chaining)
    assert ours.mask_padding
    perturb(ref)
    swin_backbone.load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    assert_same_features(ours, ref, (224, 224))
    with torch.no_grad():
        x = torch.randn(1, 3, *ODD_SIZE)
        diffs = [(g - e).abs().max().item() for g, e in zip(ours(x), ref(x))]
    assert max(diffs) > 1e-2, diffs


def test_mmseg_model_level_pretrained_reaches_the_backbone():
    # mmseg's EncoderDecoder hands its own ``pretrained=`` to the backbone as ``pretrained``.
    path = "swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py"
    cfg = Config.fromfile(os.path.join(config_root("mmseg"), path), import_custom_modules=False)
    cfg.model.backbone = one_word_change(dict(cfg.model.backbone, init_cfg=None))
    cfg.model.pretrained = "x.pth"
    with pytest.warns(UserWarning, match="pretrained is deprecated"):
        model = build("mmseg", cfg.model)
    assert isinstance(model.backbone, SwinBackbone)
    assert model.backbone.init_cfg == dict(type="Pretrained", checkpoint="x.pth")


# ---------------------------------------------------------------- argument forms
def test_pretrained_becomes_init_cfg():
    with pytest.warns(UserWarning, match="pretrained is deprecated, please use \"init_cfg\" instead"):
        model = SwinBackbone(**small_arch(pretrained="x.pth"))
    assert model.init_cfg == dict(type="Pretrained", checkpoint="x.pth")
    assert SwinBackbone(**small_arch()).init_cfg is None


def test_pretrained_path_loads_in_init_weights(tmp_path):
    from mmdet.models.backbones import SwinTransformer

    arch = dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16))
    ref = SwinTransformer(**arch)
    ref.eval()
    perturb(ref)
    path = str(tmp_path / "ref.pth")
    torch.save({"state_dict": ref.state_dict()}, path)
    with pytest.warns(UserWarning, match="pretrained is deprecated"):
        ours = SwinBackbone(arch=None, **arch, pretrained=path, mask_padding=False)
    ours.init_weights()
    ours.eval()
    assert_same_features(ours, ref)


@pytest.mark.parametrize(
    "form,hw",
    [(224, (224, 224)), ((224,), (224, 224)), ([224], (224, 224)), ((224, 224), (224, 224)), ((192, 320), (192, 320))],
)
def test_pretrain_img_size_forms(form, hw):
    from mmdet.models.backbones import SwinTransformer

    arch = dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16), use_abs_pos_embed=True)
    ours = SwinBackbone(arch=None, **arch, pretrain_img_size=form)
    assert ours.absolute_pos_embed.shape[-2:] == (hw[0] // 4, hw[1] // 4)
    if not isinstance(form, list):  # mmdet takes tuples only
        ref = SwinTransformer(**arch, pretrain_img_size=form)
        assert ref.absolute_pos_embed.shape[1] == ours.absolute_pos_embed.shape[-2:].numel()


@pytest.mark.parametrize(
    "act_cfg", [None, dict(type="GELU"), dict(type="GELU", approximate="none"), dict(type=nn.GELU)]
)
@pytest.mark.parametrize(
    "norm_cfg",
    [None, dict(type="LN"), dict(type="LN", requires_grad=True), dict(type="LN", eps=1e-5), dict(type=nn.LayerNorm)],
)
def test_accepted_layer_cfgs_are_what_mmcv_builds_from_them(act_cfg, norm_cfg):
    from mmcv.cnn import build_activation_layer, build_norm_layer

    SwinBackbone(**small_arch(act_cfg=act_cfg, norm_cfg=norm_cfg))
    if act_cfg is not None:  # mmcv builds exactly the layer SwinBackbone uses
        act = build_activation_layer(copy.deepcopy(act_cfg))
        assert type(act) is nn.GELU and act.approximate == "none"
    if norm_cfg is not None:
        norm = build_norm_layer(copy.deepcopy(norm_cfg), 8)[1]
        assert type(norm) is nn.LayerNorm and norm.eps == 1e-5 and norm.elementwise_affine
        assert all(p.requires_grad for p in norm.parameters())


@pytest.mark.parametrize(
    "patch_size,strides",
    [(4, (4, 2, 2, 2)), (4, [4, 2, 2, 2]), ((4, 4), ((4, 4), 2, 2, 2)), (2, (2, 2, 2, 2))],
)
def test_strides_consistent_with_patch_size_match_mmdet(patch_size, strides):
    from mmdet.models.backbones import SwinTransformer

    arch = dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16))
    ref = SwinTransformer(**arch, patch_size=patch_size, strides=strides, drop_path_rate=0.0)
    ref.eval()
    ours = SwinBackbone(arch=None, **arch, patch_size=patch_size, strides=strides, mask_padding=False).eval()
    perturb(ref)
    swin_backbone.load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    assert_same_features(ours, ref)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(act_cfg=dict(type="ReLU")), "act_cfg"),
        (dict(act_cfg=dict(type="GELU", approximate="tanh")), "act_cfg"),
        (dict(act_cfg="GELU"), "act_cfg"),
        (dict(act_cfg=dict(type="mmdet.GELU")), "act_cfg"),  # mmdet cannot build it either
        (dict(norm_cfg=dict(type="BN")), "norm_cfg"),
        (dict(norm_cfg=dict(type="LN", eps=1e-6)), "norm_cfg"),
        (dict(norm_cfg=dict(type="LN", requires_grad=False)), "norm_cfg"),
        (dict(strides=(2, 2, 2, 2)), "strides"),  # patch_size is 4
        (dict(patch_size=2, strides=(4, 2, 2, 2)), "strides"),
        (dict(strides=(4, 2, 2)), "strides"),
        (dict(strides=(4, 2, 2, 2, 2)), "strides"),
        (dict(strides=4), "strides"),
        (dict(strides=(4, 2, 1, 2)), "strides"),
        (dict(strides=(4, 2, 2, 4)), "strides"),
        (dict(pretrain_img_size=(1, 2, 3)), "pretrain_img_size"),
        (dict(pretrain_img_size=()), "pretrain_img_size"),
        (dict(pretrain_img_size=(2, 2)), "pretrain_img_size"),  # smaller than a patch
        (dict(patch_size=(4, 2)), "patch_size"),
        (dict(pretrained=3), "pretrained"),
        (dict(pretrained=""), "pretrained"),
        (dict(pretrained="x.pth", init_cfg=dict(type="Pretrained", checkpoint="y.pth")), "pretrained"),
    ],
)
def test_values_this_backbone_cannot_honour_raise(kwargs, argument):
    with pytest.raises(ValueError, match=rf"^{argument}: expected "):
        SwinBackbone(**small_arch(**kwargs))


def test_translation_is_a_pure_function_of_its_arguments():
    init = dict(type="Pretrained", checkpoint="y.pth")
    args = translate_mmlab_args(
        num_stages=4,
        patch_size=(4, 4),
        strides=[4, 2, 2, 2],
        pretrain_img_size=(384,),
        act_cfg=dict(type=nn.GELU),
        norm_cfg=dict(type="LN", requires_grad=True),
        pretrained=None,
        init_cfg=init,
    )
    assert (args.patch_size, args.pretrain_img_size, args.init_cfg) == (4, (384, 384), init)
    assert init == dict(type="Pretrained", checkpoint="y.pth")  # the input is not modified
