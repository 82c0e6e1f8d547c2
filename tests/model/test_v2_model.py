"""Swin V2: parity with timm and torchvision (random perturbed weights, through each one's own
checkpoint), the fine-tune position bias, any size, precisions, gradients, tracing, freezing."""
import dataclasses
import math
import re

import pytest
import torch

import swin_backbone
from swin_backbone import CheckpointError, SwinBackbone, SwinV2Backbone, load_checkpoint, ops
from swin_backbone.model.v2 import SwinBlockV2, WindowAttentionV2
from swin_backbone.ops import cosine

from ..helpers import randomize as _randomize
from ..helpers import timm_stages as _timm_stages

ATOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")


def _compare(ours, stage_outs, final_norm, got):
    """Stages 1-3 through our (random) output norms, stage 4 through the reference's final norm."""
    for i, (g, o) in enumerate(zip(got, stage_outs)):
        norm = final_norm if i == len(stage_outs) - 1 else getattr(ours, f"norm{i}")
        torch.testing.assert_close(g, norm(o).permute(0, 3, 1, 2), rtol=ATOL, atol=ATOL, msg=lambda m: f"stage {i}: {m}")


def _with_random_output_norms(model):
    with torch.no_grad():
        for i in model.out_indices:
            getattr(model, f"norm{i}").weight.normal_(1.0, 0.1)
            getattr(model, f"norm{i}").bias.normal_(std=0.1)
    return model


# ---------------------------------------------------------------- parity
def test_timm_tiny_window8_parity_through_its_checkpoint():
    timm = pytest.importorskip("timm")
    ref = _randomize(timm.create_model("swinv2_tiny_window8_256", pretrained=False))
    ours = _with_random_output_norms(SwinV2Backbone("tiny", pad_small_map=False).eval())
    report = load_checkpoint(ours, ref.state_dict(), logger=None)
    assert report.format == "timm-v2"
    # our stage 1-3 output norms are not in a classification checkpoint; everything else is
    assert report.missing == [f"norm{i}.{p}" for i in range(3) for p in ("weight", "bias")]
    assert not report.unexpected and not report.mismatched
    assert "stages.0.downsample.reduction.weight" in report.converted
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        _compare(ours, _timm_stages(ref, x), ref.norm, ours(x))


def test_official_layout_checkpoint_derived_from_timm():
    timm = pytest.importorskip("timm")
    ref = _randomize(timm.create_model("swinv2_tiny_window8_256", pretrained=False))
    state = {}
    for key, value in ref.state_dict().items():
        key = re.sub(r"^layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m.group(1)) - 1}.downsample.", key)
        state[key.replace("head.fc.", "head.")] = value
    # the official model saves its buffers: they must be dropped, not loaded
    state["layers.0.blocks.0.attn.relative_coords_table"] = torch.zeros(1, 15, 15, 2)
    state["layers.0.blocks.0.attn.relative_position_index"] = torch.zeros(64, 64, dtype=torch.long)
    state["layers.0.blocks.1.attn_mask"] = torch.zeros(64, 64, 64)
    ours = _with_random_output_norms(SwinV2Backbone("tiny", out_indices=(3,), pad_small_map=False).eval())
    report = load_checkpoint(ours, {"model": state}, strict=True, logger=None)
    assert report.format == "official-v2"
    assert "layers.0.blocks.1.attn_mask" in report.skipped
    assert "norm3.weight" in report.converted
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        (got,) = ours(x)
    expected = ref.norm(_timm_stages(ref, x)[-1]).permute(0, 3, 1, 2)
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL)


def test_torchvision_swin_v2_t_parity_through_its_checkpoint():
    from torchvision.models import swin_v2_t

    ref = _randomize(swin_v2_t(weights=None))
    with torch.no_grad():  # torchvision zeroes the k slice in every forward; its checkpoint has zeros there
        for name, p in ref.named_parameters():
            if name.endswith("attn.qkv.bias"):
                p[p.numel() // 3 : 2 * p.numel() // 3] = 0
    ours = _with_random_output_norms(SwinV2Backbone("tiny", pad_small_map=False, mask_padding=False).eval())
    report = load_checkpoint(ours, ref.state_dict(), logger=None)
    assert report.format == "torchvision-v2"
    assert not report.unexpected and not report.mismatched
    assert any("relative_coords_table" in k for k in report.skipped)
    x = torch.randn(1, 3, 320, 288)  # maps 80x72 .. 10x9: window padding and shifts in every stage
    outs = []
    y = x
    with torch.no_grad():
        for k, feature in enumerate(ref.features):
            y = feature(y)
            if k % 2 == 1:
                outs.append(y)
        _compare(ours, outs, ref.norm, ours(x))


def test_torchvision_non_zero_k_bias_is_dropped_as_torchvision_does():
    # torchvision zeroes the k slice of the fused qkv bias in every forward: the file's model
    # is the one without it (its forward parity: tests/checkpoint/test_checkpoint_sources.py).
    from torchvision.models import swin_v2_t

    state = swin_v2_t(weights=None).state_dict()
    state["features.1.0.attn.qkv.bias"][100] = 1.0  # C = 96: element 100 is in the k slice
    report = load_checkpoint(SwinV2Backbone("tiny"), state, logger=None)
    assert "features.1.0.attn.qkv.bias [k slice]" in report.skipped


def test_fine_tune_window16_from_pretrained_window8_matches_timm():
    timm = pytest.importorskip("timm")
    arch = dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 4, 8))
    ref = _randomize(timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=512, window_size=16,
                                       pretrained_window_sizes=(8, 8, 8, 8), **arch))
    ours = SwinV2Backbone(arch=None, embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 4, 8), window_size=16,
                          pretrained_window_sizes=8, pad_small_map=False).eval()
    _with_random_output_norms(ours)
    load_checkpoint(ours, ref.state_dict(), logger=None)
    x = torch.randn(1, 3, 512, 512)  # maps 128 .. 16: window 16, shifted, in every stage
    with torch.no_grad():
        _compare(ours, _timm_stages(ref, x), ref.norm, ours(x))
    # the pretrained window matters: normalising by 16 instead of 8 changes the features
    other = SwinV2Backbone(arch=None, embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 4, 8), window_size=16,
                           pad_small_map=False).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert not torch.allclose(other(x)[0], ours(x)[0], atol=1e-3)


def test_published_names_and_per_stage_windows():
    model = SwinV2Backbone("swinv2_base_window12to16_192to256")
    assert model.window_sizes == (16,) * 4 and model.pretrained_window_sizes == (12, 12, 12, 6)
    assert model.embed_dims == 128
    assert model.stages[3].blocks[0].attn.pretrained_window_size == 6
    per_stage = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), window_size=(8, 4),
                               out_indices=(0, 1))
    assert [s.window_size for s in per_stage.stages] == [8, 4]
    assert per_stage.window_size == (8, 4)
    with torch.no_grad():
        outs = per_stage(torch.randn(1, 3, 70, 50))
    assert [tuple(o.shape[-2:]) for o in outs] == [(18, 13), (9, 7)]


# ---------------------------------------------------------------- the arithmetic
def test_log_spaced_coords_match_timm_table():
    timm = pytest.importorskip("timm")
    from timm.models.swin_transformer_v2 import WindowAttention

    for window, pretrained in [(8, 0), (16, 8), (12, 12), (24, 12), (3, 0)]:
        attn = WindowAttention(16, (window, window), 2, pretrained_window_size=(pretrained, pretrained))
        expected = attn.relative_coords_table.reshape(-1, 2)
        torch.testing.assert_close(cosine.log_spaced_coords(window, pretrained), expected, rtol=0, atol=0)
    assert torch.equal(cosine.log_spaced_coords(1, 0), torch.zeros(1, 2))  # no 0 / 0
    cached = cosine.get_log_spaced_coords(8, 0, torch.device("cpu"), torch.float32)
    assert cosine.get_log_spaced_coords(8, 0, torch.device("cpu"), torch.float32) is cached


def test_cosine_qkv_clamps_and_keeps_zero_keys_finite_in_half_precision():
    qkv = torch.randn(2, 5, 3 * 8)
    qkv[:, 0] = 0  # a padding token: all-zero q and k (zero k bias), zero v
    scale = torch.tensor([1.0, 10.0]).view(2, 1, 1)  # head 1 above log(100): clamped
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = cosine.cosine_qkv(qkv.to(dtype), scale, 2)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert (out[:, 0] == 0).all()
    out = cosine.cosine_qkv(qkv, scale, 2).view(2, 5, 3, 2, 4)
    norms = out[:, 1:, :2].norm(dim=-1)
    torch.testing.assert_close(norms[:, :, 0, 0], torch.full((2, 4), math.e))
    torch.testing.assert_close(norms[:, :, 0, 1], torch.full((2, 4), 100.0))
    torch.testing.assert_close(norms[:, :, 1], torch.ones(2, 4, 2))
    torch.testing.assert_close(out[:, :, 2], qkv.view(2, 5, 3, 2, 4)[:, :, 2])


@pytest.mark.parametrize("size", [(1, 1), (33, 47), (16, 2048)])
def test_any_size(size):
    model = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)).eval()
    model.init_weights()
    _randomize(model)
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *size))
    h, w = size
    for i, o in enumerate(outs):
        h, w = math.ceil(h / (4 if i == 0 else 2)), math.ceil(w / (4 if i == 0 else 2))
        assert o.shape == (1, 16 * 2**i, h, w) and torch.isfinite(o).all()


def test_every_kernel_gives_the_same_v2_features():
    # SDPA (inference), plain matmul + softmax, and the CPU recompute kernel (training) with its
    # hand-written backward all serve V2 unchanged: same features, same gradients.
    model = _randomize(SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4,
                                      out_indices=(0, 1), drop_path_rate=0.0))
    x = torch.randn(2, 3, 37, 45)
    with torch.no_grad():
        fused = model(x)
        with ops.override(sdpa=False):
            plain = model(x)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=ATOL, atol=ATOL)
    grads = []
    model.double()  # float64: weight gradients sum many tokens; fp32 ordering noise would hide bugs
    for switches in (dict(), dict(recompute_attention=False, save_memory=False)):
        model.zero_grad()
        with ops.override(**switches):
            outs = model.train()(x.double())
        sum(o.square().sum() for o in outs).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for a, b in zip(outs, fused):
            torch.testing.assert_close(a.float(), b, rtol=ATOL, atol=ATOL)
    for name, g in grads[0].items():
        for other in grads[1:]:
            torch.testing.assert_close(g, other[name], msg=lambda m: f"{name}: {m}")
    assert grads[0]["stages.0.blocks.1.attn.cpb_mlp.0.weight"].abs().sum() > 0
    assert grads[0]["stages.0.blocks.1.attn.logit_scale"].abs().sum() > 0


def test_float64_gradcheck_through_recompute_kernel_and_cosine_prep():
    from torch.func import functional_call

    from swin_backbone.ops.layouts import get_window_layout

    attn = _randomize(WindowAttentionV2(8, 2, 4)).double()
    layout = get_window_layout(5, 6, 4, 2, True, torch.device("cpu"), torch.float64)
    plan = ops.plan_for(torch.zeros(1, dtype=torch.float64), grad=True, attention="recompute", chunk_bytes=0)
    x = torch.randn(1, 30, 8, dtype=torch.float64, requires_grad=True)
    # the module's own forward, with logit_scale as an input of the check
    layout = dataclasses.replace(layout, plan=plan)
    assert torch.autograd.gradcheck(lambda t, s: functional_call(attn, {"logit_scale": s}, (t, layout)),
                                    (x, attn.logit_scale.detach().clone().requires_grad_(True)))


def test_training_gradients_match_timm_in_float64():
    timm = pytest.importorskip("timm")
    ref = _randomize(timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=64, embed_dim=16, drop_path_rate=0.0,
                                       depths=(2, 2), num_heads=(2, 4)))
    ours = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), out_indices=(1,),
                          pad_small_map=False, drop_path_rate=0.0)
    load_checkpoint(ours, ref.state_dict(), strict=True, logger=None)
    ref.double().train()
    ours.double().train()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    (got,) = ours(x)
    expected = ref.norm(_timm_stages(ref, x)[-1]).permute(0, 3, 1, 2)
    torch.testing.assert_close(got, expected)
    probe = torch.randn_like(got)
    ours_grads = dict(zip([n for n, _ in ours.named_parameters()],
                          torch.autograd.grad((got * probe).sum(), list(ours.parameters()))))
    ref_grads = dict(zip([n for n, _ in ref.named_parameters() if not n.startswith("head")],
                         torch.autograd.grad((expected * probe).sum(),
                                             [p for n, p in ref.named_parameters() if not n.startswith("head")])))
    from swin_backbone.checkpoint.base import to_ours

    converted, _, _ = to_ours(ref_grads, "timm-v2")
    assert set(converted) == set(ours_grads)
    for name, g in ours_grads.items():
        torch.testing.assert_close(g, converted[name], msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- precision
def test_bf16_fp16_pure_and_autocast_with_padding_are_finite():
    model = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), out_indices=(0, 1)).eval()
    model.init_weights()
    _randomize(model)
    x = torch.randn(1, 3, 45, 61)  # padded windows in both stages
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(x)
        results = [amp]
        for dtype in (torch.bfloat16, torch.float16):
            pure = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4),
                                  out_indices=(0, 1)).eval().to(dtype)
            pure.load_state_dict(model.state_dict())
            try:
                results.append(pure(x.to(dtype)))
            except (RuntimeError, NotImplementedError) as err:  # torch < 2.2: no fp16 convolution on the CPU
                assert dtype == torch.float16 and "Half" in str(err), err
    for outs in results:
        for r, o in zip(ref, outs):
            assert torch.isfinite(o).all()
            assert (o.float() - r).abs().mean() < 0.05 * r.abs().mean()
    # mmdet-style unmasked padding: padding keys take part with all-zero keys, still finite
    unmasked = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), out_indices=(0, 1),
                              mask_padding=False).eval().half()
    with torch.no_grad():
        if len(results) == 3:  # fp16 runs on this CPU
            assert all(torch.isfinite(o).all() for o in unmasked(x.half()))


# ---------------------------------------------------------------- tracing
@pytest.mark.slow  # torch.compile
@pytest.mark.torch_feature("compile", "export")
def test_torch_compile_and_export_with_dynamic_sizes():
    import torch._dynamo
    from torch.export import Dim, export

    torch._dynamo.reset()
    model = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), window_size=4,
                           out_indices=(0, 1)).eval()
    model.init_weights()
    _randomize(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, dynamic=True, backend=backend)
    height, width = Dim("height", min=32, max=1024), Dim("width", min=32, max=1024)
    exported = export(model, (torch.randn(1, 3, 64, 96),), dynamic_shapes={"x": {2: height, 3: width}}).module()
    for size in [(64, 96), (57, 41), (120, 33)]:
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            expected = model(x)
            for got in (compiled(x), exported(x)):
                for c, e in zip(got, expected):
                    torch.testing.assert_close(c, e, rtol=ATOL, atol=ATOL)
    assert len(graphs) == 1


# ---------------------------------------------------------------- structure, init, freezing, errors
def test_init_zeroes_post_norms_and_sets_logit_scale():
    model = SwinV2Backbone(arch=None, embed_dims=16, depths=(2, 6), num_heads=(1, 2), out_indices=(0, 1),
                           extra_norm_every_n_blocks=3)
    _randomize(model)
    model.init_weights()
    blocks = [b for b in model.modules() if isinstance(b, SwinBlockV2)]
    assert all(b.norm1.weight.abs().sum() == 0 and b.norm2.bias.abs().sum() == 0 for b in blocks)
    assert all(torch.allclose(b.attn.logit_scale, torch.full_like(b.attn.logit_scale, math.log(10))) for b in blocks)
    # extra norm after blocks 2 and 5 of a stage (counted from 0 within each stage)
    assert [j for j, b in enumerate(model.stages[1].blocks) if b.norm3 is not None] == [2, 5]
    assert all(b.norm3 is None for b in model.stages[0].blocks)
    # zero post-norms: every block is the identity at init
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        tokens = model.patch_embed(x)
        assert torch.equal(model.stages[0](tokens, ops.plan_for(tokens, model.stages[0])), tokens)


def test_frozen_stages_and_checkpointing():
    kw = dict(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), out_indices=(0, 1), drop_path_rate=0.0)
    # float64: the checkpointed blocks run the cosine prep with autograd, the others with its
    # memory-saving function; both are exact, but fp32 rounding differs between the two.
    plain = _randomize(SwinV2Backbone(**kw)).train().double()
    cp = SwinV2Backbone(**kw, with_cp=True).train().double()
    cp.load_state_dict(plain.state_dict())
    x = torch.randn(1, 3, 40, 40, dtype=torch.float64)
    grads = []
    for model in (plain, cp):
        sum(o.square().sum() for o in model(x)).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    x = x.float()
    frozen = SwinV2Backbone(**kw, frozen_stages=1).train()
    sum(o.sum() for o in frozen(x)).backward()
    for name, p in frozen.named_parameters():
        is_frozen = name.startswith(("patch_embed.", "stages.0.", "norm0."))
        assert (p.grad is None) == is_frozen, name
    assert not frozen.stages[0].training


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(qk_scale=0.1), "qk_scale"),
        (dict(window_size=(8, 8)), "window_size"),
        (dict(pretrained_window_sizes=-1), "pretrained_window_sizes"),
        (dict(extra_norm_every_n_blocks=-2), "extra_norm_every_n_blocks"),
        (dict(arch="tiny_v3"), "arch"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SwinV2Backbone(**kwargs)


def test_v1_and_v2_checkpoints_are_refused_by_the_other_version():
    v1, v2 = SwinBackbone("tiny"), SwinV2Backbone("tiny")
    with pytest.raises(CheckpointError, match=r"Swin V1 .*SwinV2Backbone"):
        load_checkpoint(v2, v1.state_dict(), logger=None)
    with pytest.raises(CheckpointError, match=r"Swin V2 .*SwinBackbone"):
        load_checkpoint(v1, v2.state_dict(), logger=None)
    before = {k: v.clone() for k, v in v2.state_dict().items()}
    with pytest.raises(CheckpointError):  # also through load_state_dict (the hook): no partial load
        v2.load_state_dict(v1.state_dict(), strict=False)
    assert all(torch.equal(v, before[k]) for k, v in v2.state_dict().items())


@pytest.mark.parametrize("lib", ["mmdet", "mmseg"])
def test_built_from_registry(lib):
    import importlib

    from mmengine.registry import DefaultScope

    registry = importlib.import_module(f"{lib}.registry").MODELS
    with DefaultScope.overwrite_default_scope(lib):  # (a Runner of another test may have left its scope current)
        model = registry.build(dict(type="SwinV2Backbone", arch="tiny", window_size=8,
                                    pretrained_window_sizes=[8, 8, 8, 8]))
    assert isinstance(model, swin_backbone.SwinV2Backbone)
