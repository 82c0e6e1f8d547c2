"""Hostile constructor arguments of SwinBackbone and SwinV2Backbone: for every argument a wrong
type, a bool for an int, a float for an int, zero, negative, huge and wrong-length values.
Each bad row must fail in argument validation (before any weight is allocated) with a
``ValueError`` naming the argument and what it expects; the good rows build the model."""
import numpy as np
import pytest

from swin_backbone import SwinBackbone, SwinV2Backbone

from .rows import bad, good, params, run_row

TINY = dict(arch=None, embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), drop_path_rate=0.0)


def v1(**kw):
    return lambda: SwinBackbone(**dict(TINY, **kw))


def v2(**kw):
    return lambda: SwinV2Backbone(**dict(TINY, **kw))


def has(**attrs):
    def check(model):
        for name, value in attrs.items():
            assert getattr(model, name) == value, (name, getattr(model, name), value)
    return check


E = ValueError
V1_ROWS = [
    # arch
    bad("arch-unknown", v1(arch="tinyy", embed_dims=None, depths=None, num_heads=None), E, "arch", "tiny"),
    bad("arch-int", v1(arch=5, embed_dims=None, depths=None, num_heads=None), E, "arch", "got 5"),
    bad("arch-list", v1(arch=["tiny"], embed_dims=None, depths=None, num_heads=None), E, "arch"),
    bad("arch-empty", v1(arch="", embed_dims=None, depths=None, num_heads=None), E, "arch"),
    bad("arch-none-no-sizes", v1(embed_dims=None), E, "arch=None", "embed_dims"),
    good("arch-upper-case-with-overrides", v1(arch="TINY"), has(embed_dims=16)),
    good("arch-alias-with-overrides", v1(arch="t"), has(depths=(1, 1, 1, 1))),
    # embed_dims
    bad("embed_dims-str", v1(embed_dims="abc"), E, "embed_dims", "int >= 1", "'abc'"),
    bad("embed_dims-float-truncation", v1(embed_dims=33.9), E, "embed_dims", "int", "33.9"),
    bad("embed_dims-integral-float", v1(embed_dims=16.0), E, "embed_dims", "int"),
    bad("embed_dims-bool", v1(embed_dims=True), E, "embed_dims", "int"),
    bad("embed_dims-zero", v1(embed_dims=0), E, "embed_dims", ">= 1"),
    bad("embed_dims-negative", v1(embed_dims=-16), E, "embed_dims", ">= 1"),
    bad("embed_dims-huge", v1(embed_dims=16 * 10**5), E, "embed_dims", "parameters"),
    bad("embed_dims-list", v1(embed_dims=[16]), E, "embed_dims"),
    good("embed_dims-numpy-int", v1(embed_dims=np.int64(16)), has(embed_dims=16)),
    # depths
    bad("depths-int", v1(depths=5), E, "depths", "list or tuple"),
    bad("depths-str", v1(depths="1111"), E, "depths", "list or tuple"),
    bad("depths-set", v1(depths={1, 2}), E, "depths", "list or tuple"),
    bad("depths-empty", v1(depths=(), num_heads=()), E, "depths", "non-empty"),
    bad("depths-zero", v1(depths=(1, 1, 0, 1)), E, "depths", ">= 1"),
    bad("depths-negative", v1(depths=(1, -1, 1, 1)), E, "depths", ">= 1"),
    bad("depths-float", v1(depths=(1.0, 1, 1, 1)), E, "depths", "ints"),
    bad("depths-bool", v1(depths=(True, 1, 1, 1)), E, "depths", "ints"),
    bad("depths-huge", v1(depths=(10**6, 1, 1, 1)), E, "depths", "blocks"),
    bad("depths-many-stages", v1(depths=(1,) * 40, num_heads=(1,) * 40, out_indices=(0,)), E, "parameters"),
    bad("depths-shorter-than-num_heads", v1(depths=(1, 1, 1)), E, "num_heads", "one entry per stage"),
    good("depths-list", v1(depths=[1, 1, 1, 1]), has(depths=(1, 1, 1, 1))),
    good("depths-three-stages", v1(depths=(1, 1, 1), num_heads=(1, 2, 4), out_indices=(0, 1, 2)), has(num_stages=3)),
    # num_heads
    bad("num_heads-int", v1(num_heads=3), E, "num_heads", "list or tuple"),
    bad("num_heads-str", v1(num_heads="1248"), E, "num_heads", "list or tuple"),
    bad("num_heads-wrong-length", v1(num_heads=(1, 2, 4)), E, "num_heads", "one entry per stage"),
    bad("num_heads-zero", v1(num_heads=(0, 2, 4, 8)), E, "num_heads[0]", ">= 1"),
    bad("num_heads-negative", v1(num_heads=(1, -2, 4, 8)), E, "num_heads[1]", ">= 1"),
    bad("num_heads-float", v1(num_heads=(1, 2, 4.5, 8)), E, "num_heads[2]", "int"),
    bad("num_heads-bool", v1(num_heads=(True, 2, 4, 8)), E, "num_heads[0]", "int"),
    bad("num_heads-not-a-divisor", v1(num_heads=(3, 2, 4, 8)), E, "num_heads[0]", "divisor"),
    # in_channels / patch_size
    bad("in_channels-zero", v1(in_channels=0), E, "in_channels", ">= 1"),
    bad("in_channels-negative", v1(in_channels=-3), E, "in_channels", ">= 1"),
    bad("in_channels-float", v1(in_channels=3.0), E, "in_channels", "int"),
    bad("in_channels-bool", v1(in_channels=True), E, "in_channels", "int"),
    bad("in_channels-str", v1(in_channels="3"), E, "in_channels", "int"),
    good("in_channels-one", v1(in_channels=1), has(in_channels=1)),
    bad("patch_size-zero", v1(patch_size=0), E, "patch_size"),
    bad("patch_size-negative", v1(patch_size=-4), E, "patch_size"),
    bad("patch_size-float", v1(patch_size=4.5), E, "patch_size"),
    bad("patch_size-bool", v1(patch_size=True), E, "patch_size"),
    bad("patch_size-non-square", v1(patch_size=(4, 2)), E, "patch_size", "square"),
    bad("patch_size-str", v1(patch_size="4"), E, "patch_size"),
    good("patch_size-pair", v1(patch_size=(4, 4)), has(patch_size=4)),
    # window_size
    bad("window_size-zero", v1(window_size=0), E, "window_size", "[1, 128]"),
    bad("window_size-negative", v1(window_size=-7), E, "window_size", "[1, 128]"),
    bad("window_size-float", v1(window_size=7.5), E, "window_size", "int"),
    bad("window_size-bool", v1(window_size=True), E, "window_size", "int"),
    bad("window_size-str", v1(window_size="7"), E, "window_size", "int"),
    bad("window_size-huge-1000", v1(window_size=1000), E, "window_size", "[1, 128]", "1000"),
    bad("window_size-just-above-cap", v1(window_size=129), E, "window_size", "129"),
    bad("window_size-pair", v1(window_size=(7, 7)), E, "window_size"),
    good("window_size-one", v1(window_size=1), has(window_size=1)),
    good("window_size-cap", v1(window_size=128), has(window_size=128)),
    # mlp_ratio / qk_scale / rates
    bad("mlp_ratio-zero", v1(mlp_ratio=0), E, "mlp_ratio", "> 0"),
    bad("mlp_ratio-negative", v1(mlp_ratio=-1.0), E, "mlp_ratio", "> 0"),
    bad("mlp_ratio-nan", v1(mlp_ratio=float("nan")), E, "mlp_ratio", "> 0"),
    bad("mlp_ratio-inf", v1(mlp_ratio=float("inf")), E, "mlp_ratio"),
    bad("mlp_ratio-str", v1(mlp_ratio="4"), E, "mlp_ratio"),
    bad("mlp_ratio-bool", v1(mlp_ratio=True), E, "mlp_ratio"),
    bad("mlp_ratio-huge", v1(mlp_ratio=1e9), E, "mlp_ratio", "parameters"),
    good("mlp_ratio-fraction", v1(mlp_ratio=0.5)),
    bad("qk_scale-negative", v1(qk_scale=-1.0), E, "qk_scale", "> 0"),
    bad("qk_scale-zero", v1(qk_scale=0), E, "qk_scale", "> 0"),
    bad("qk_scale-nan", v1(qk_scale=float("nan")), E, "qk_scale", "finite"),
    bad("qk_scale-str", v1(qk_scale="0.1"), E, "qk_scale"),
    bad("qk_scale-bool", v1(qk_scale=True), E, "qk_scale"),
    good("qk_scale-number", v1(qk_scale=0.25)),
    bad("drop_rate-one", v1(drop_rate=1.0), E, "drop_rate", "[0, 1)"),
    bad("drop_rate-negative", v1(drop_rate=-0.1), E, "drop_rate", "[0, 1)"),
    bad("drop_rate-nan", v1(drop_rate=float("nan")), E, "drop_rate"),
    bad("drop_rate-str", v1(drop_rate="0.1"), E, "drop_rate"),
    bad("drop_rate-bool", v1(drop_rate=True), E, "drop_rate"),
    bad("attn_drop_rate-above-one", v1(attn_drop_rate=1.5), E, "attn_drop_rate"),
    bad("attn_drop_rate-none", v1(attn_drop_rate=None), E, "attn_drop_rate"),
    bad("drop_path_rate-one", v1(drop_path_rate=1.0), E, "drop_path_rate"),
    bad("drop_path_rate-negative", v1(drop_path_rate=-0.5), E, "drop_path_rate"),
    good("drop_path_rate-int-zero", v1(drop_path_rate=0), has(drop_path_rate=0)),
    # switches: a string such as 'False' is truthy and would silently switch the option on
    *[bad(f"{flag}-string", v1(**{flag: "False"}), E, flag, "True or False")
      for flag in ("qkv_bias", "use_abs_pos_embed", "patch_norm", "with_cp", "pad_small_map", "mask_padding",
                   "channels_last_outputs", "convert_weights")],
    bad("with_cp-none", v1(with_cp=None), E, "with_cp", "True or False"),
    bad("mask_padding-two", v1(mask_padding=2), E, "mask_padding", "True or False"),
    bad("patch_norm-list", v1(patch_norm=[]), E, "patch_norm"),
    good("with_cp-int-one", v1(with_cp=1)),
    good("pad_small_map-numpy-bool", v1(pad_small_map=np.bool_(False))),
    # pretrain_img_size
    bad("pretrain_img_size-zero", v1(pretrain_img_size=0), E, "pretrain_img_size"),
    bad("pretrain_img_size-negative", v1(pretrain_img_size=-224), E, "pretrain_img_size"),
    bad("pretrain_img_size-below-patch", v1(pretrain_img_size=2), E, "pretrain_img_size", "patch_size"),
    bad("pretrain_img_size-three", v1(pretrain_img_size=(224, 224, 3)), E, "pretrain_img_size"),
    bad("pretrain_img_size-str", v1(pretrain_img_size="224"), E, "pretrain_img_size"),
    bad("pretrain_img_size-float", v1(pretrain_img_size=224.5), E, "pretrain_img_size"),
    good("pretrain_img_size-pair", v1(pretrain_img_size=(224, 320), use_abs_pos_embed=True)),
    # out_indices / frozen_stages
    bad("out_indices-empty", v1(out_indices=()), E, "out_indices", "non-empty"),
    bad("out_indices-out-of-range", v1(out_indices=(4,)), E, "out_indices", "[0, 3]"),
    bad("out_indices-negative", v1(out_indices=(-1,)), E, "out_indices", "[0, 3]"),
    bad("out_indices-duplicate", v1(out_indices=(0, 0)), E, "out_indices", "distinct"),
    bad("out_indices-int", v1(out_indices=0), E, "out_indices"),
    bad("out_indices-str", v1(out_indices="0123"), E, "out_indices"),
    bad("out_indices-bool", v1(out_indices=(True,)), E, "out_indices"),
    bad("out_indices-float", v1(out_indices=(0.0,)), E, "out_indices"),
    good("out_indices-unsorted-list", v1(out_indices=[3, 1]), has(out_indices=(1, 3))),
    bad("frozen_stages-below", v1(frozen_stages=-2), E, "frozen_stages", "[-1, 4]"),
    bad("frozen_stages-above", v1(frozen_stages=5), E, "frozen_stages", "[-1, 4]"),
    bad("frozen_stages-float", v1(frozen_stages=1.0), E, "frozen_stages"),
    bad("frozen_stages-bool", v1(frozen_stages=True), E, "frozen_stages"),
    bad("frozen_stages-none", v1(frozen_stages=None), E, "frozen_stages"),
    good("frozen_stages-all", v1(frozen_stages=4), has(frozen_stages=4)),
    # mmdet / mmseg drop-in arguments
    bad("strides-short", v1(strides=(4, 2, 2)), E, "strides"),
    bad("strides-wrong-merge", v1(strides=(4, 2, 2, 3)), E, "strides", "2"),
    bad("strides-wrong-patch", v1(strides=(2, 2, 2, 2)), E, "strides", "patch_size"),
    bad("strides-str", v1(strides="4222"), E, "strides"),
    good("strides-mmdet", v1(strides=(4, 2, 2, 2))),
    bad("act_cfg-relu", v1(act_cfg=dict(type="ReLU")), E, "act_cfg", "GELU"),
    bad("act_cfg-str", v1(act_cfg="GELU"), E, "act_cfg"),
    good("act_cfg-gelu", v1(act_cfg=dict(type="GELU"))),
    bad("norm_cfg-bn", v1(norm_cfg=dict(type="BN")), E, "norm_cfg", "LN"),
    good("norm_cfg-ln", v1(norm_cfg=dict(type="LN"))),
    bad("pretrained-int", v1(pretrained=5), E, "pretrained", "path"),
    bad("pretrained-and-init_cfg", v1(pretrained="a.pth", init_cfg=dict(type="Pretrained", checkpoint="b.pth")),
        E, "pretrained", "init_cfg"),
    bad("unknown-keyword", v1(window=7), TypeError, "window"),
]

V2_ROWS = [
    bad("v2-arch-unknown", v2(arch="tinyy"), E, "arch", "published model name"),
    bad("v2-arch-list", v2(arch=["tiny"]), E, "arch"),
    bad("v2-embed_dims-float", v2(embed_dims=33.9), E, "embed_dims", "int"),
    bad("v2-embed_dims-str", v2(embed_dims="abc"), E, "embed_dims", "int"),
    bad("v2-depths-str", v2(depths="abc"), E, "depths", "list or tuple"),
    bad("v2-num_heads-int", v2(num_heads=4), E, "num_heads", "list or tuple"),
    bad("v2-window_size-zero", v2(window_size=0), E, "window_size", ">= 1"),
    bad("v2-window_size-float", v2(window_size=7.5), E, "window_size"),
    bad("v2-window_size-wrong-length", v2(window_size=(8, 8, 8)), E, "window_size", "4 stages"),
    bad("v2-window_size-huge", v2(window_size=(8, 8, 8, 1000)), E, "window_size", "[1, 128]"),
    bad("v2-window_size-str", v2(window_size="8"), E, "window_size"),
    bad("v2-pretrained_window_sizes-negative", v2(pretrained_window_sizes=-1), E, "pretrained_window_sizes", ">= 0"),
    bad("v2-pretrained_window_sizes-wrong-length", v2(pretrained_window_sizes=(12, 12, 12)), E,
        "pretrained_window_sizes", "4 stages"),
    bad("v2-pretrained_window_sizes-float", v2(pretrained_window_sizes=12.0), E, "pretrained_window_sizes"),
    bad("v2-extra_norm-negative", v2(extra_norm_every_n_blocks=-1), E, "extra_norm_every_n_blocks", ">= 0"),
    bad("v2-extra_norm-float", v2(extra_norm_every_n_blocks=1.5), E, "extra_norm_every_n_blocks"),
    bad("v2-extra_norm-bool", v2(extra_norm_every_n_blocks=True), E, "extra_norm_every_n_blocks"),
    bad("v2-qk_scale", v2(qk_scale=0.5), E, "qk_scale", "None"),
    bad("v2-with_cp-string", v2(with_cp="yes"), E, "with_cp", "True or False"),
    good("v2-published-name-sets-the-window", v2(arch="swinv2_tiny_window16_256"), has(window_size=16)),
    good("v2-per-stage-windows", v2(window_size=(8, 8, 4, 2)), has(window_sizes=(8, 8, 4, 2))),
]


@pytest.mark.parametrize("row", params(V1_ROWS + V2_ROWS))
def test_constructor_row(row):
    run_row(row)
