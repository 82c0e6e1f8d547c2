"""SwinBackbone: registry, shapes at any size, parity with mmdet / mmseg, padding masks,
caching, freezing, checkpointing, precision and argument checks."""
import dataclasses
import math

import pytest
import torch

import swin_backbone
from swin_backbone import SwinBackbone
from swin_backbone.ops import layouts as L, windows as W

from ..helpers import small_arch
from ..helpers import randomize

ODD_SIZES = [(1, 1), (31, 33), (65, 97), (227, 301), (33, 800), (512, 512)]


def _inputs(batch, size):
    return torch.randn(batch, 3, *size)


# ---------------------------------------------------------------- registry
@pytest.mark.parametrize("lib", ["mmdet", "mmseg"])
def test_built_from_registry(lib):
    registry = __import__(f"{lib}.registry", fromlist=["MODELS"]).MODELS
    model = registry.build(dict(type="SwinBackbone", arch="tiny", out_indices=(1, 3)))
    assert isinstance(model, SwinBackbone)
    assert lib in swin_backbone.REGISTERED_IN
    outs = model.eval()(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [192, 768]


# ---------------------------------------------------------------- shapes
@pytest.mark.parametrize("size", ODD_SIZES)
@pytest.mark.parametrize("batch", [1, 3])
def test_shapes_at_any_size(size, batch):
    model = SwinBackbone(**small_arch()).eval()
    with torch.no_grad():
        outs = model(_inputs(batch, size))
    expected = W.output_size(*size, 4, 4)
    assert len(outs) == 4
    for i, (out, hw) in enumerate(zip(outs, expected)):
        assert out.shape == (batch, 32 * 2**i, *hw)
        assert torch.isfinite(out).all()
    assert expected[0] == (math.ceil(size[0] / 4), math.ceil(size[1] / 4))


def test_outputs_are_contiguous_nchw_unless_asked():
    x = torch.randn(1, 3, 64, 64)
    for flag in (False, True):
        model = SwinBackbone(**small_arch(channels_last_outputs=flag)).eval()
        outs = model(x)
        assert all(o.is_contiguous() != flag for o in outs)
        assert all(o.is_contiguous(memory_format=torch.channels_last) for o in outs) == flag
    # why the default matters: mmcv's CPU RoIAlign silently misreads channels-last memory
    from mmcv.ops import roi_align

    feat = torch.randn(1, 8, 20, 20)
    rois = torch.tensor([[0, 2.0, 3.0, 15.0, 12.0]])
    plain = roi_align(feat, rois, (7, 7), 1.0, 2, "avg", True)
    cl = roi_align(feat.contiguous(memory_format=torch.channels_last), rois, (7, 7), 1.0, 2, "avg", True)
    from swin_backbone import mmcv_lite

    # (mmcv-lite runs torchvision's RoIAlign, which reads either memory format)
    assert torch.allclose(plain, cl) == mmcv_lite.active()


def test_out_indices_subset_and_order():
    model = SwinBackbone(**small_arch(out_indices=(2, 1))).eval()
    outs = model(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [64, 128]
    assert not hasattr(model, "norm0") and hasattr(model, "norm2")


@pytest.mark.parametrize("arch", ["v1", "v2"])
def test_stages_after_the_last_output_train_under_ddp(arch, tmp_path):
    # Stages after the last of out_indices never run: their parameters are not trainable,
    # so DDP with find_unused_parameters=False (mmengine's default) trains for several
    # iterations; every trainable parameter gets a gradient; checkpoints of the full model
    # still load (the stages exist).
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from swin_backbone import SwinV2Backbone, load_checkpoint

    cls = SwinBackbone if arch == "v1" else SwinV2Backbone
    model = cls(**small_arch(out_indices=(0, 1, 2)))
    unused = ["stages.2.downsample.", "stages.3."]
    for name, p in model.named_parameters():
        assert p.requires_grad != any(name.startswith(u) for u in unused), name
    full = {k: v for k, v in cls(**small_arch()).state_dict().items() if not k.startswith("norm3.")}
    load_checkpoint(model, full, strict=True, logger=None)  # every stage's weights load
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model, find_unused_parameters=False)
        for _ in range(3):
            model.zero_grad()
            sum(o.square().mean() for o in ddp(torch.randn(1, 3, 64, 64))).backward()
    finally:
        dist.destroy_process_group()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------- parity with mmdet / mmseg
def _reference(lib, **kw):
    if lib == "mmdet":
        from mmdet.models.backbones import SwinTransformer
    else:
        from mmseg.models.backbones import SwinTransformer
    return SwinTransformer(**kw)


@pytest.mark.parametrize("lib", ["mmdet", "mmseg"])
def test_parity_with_reference(lib, device):
    arch = dict(embed_dims=96, depths=(2, 2, 2, 2), num_heads=(3, 6, 12, 24), window_size=7)
    ref = _reference(lib, **arch, drop_path_rate=0.0)
    ref.init_weights()
    ref.eval()  # (mmdet's train() returns None, so no chaining)
    with torch.no_grad():  # non-trivial biases so that any layout error shows
        for name, p in ref.named_parameters():
            if name.endswith("relative_position_bias_table") or name.endswith(".bias"):
                p.normal_(std=0.1)
    ours = SwinBackbone(arch=None, **arch, mask_padding=False, pad_small_map=True).eval()
    report = swin_backbone.load_checkpoint(ours, {"state_dict": ref.state_dict()}, strict=True)
    assert report.format == "mmdet" and report.complete
    ref.to(device)
    ours.to(device)
    for size in ODD_SIZES:
        x = _inputs(1, size).to(device)
        with torch.no_grad():
            expected = ref(x)
            got = ours(x)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=f"{lib} at {size}")


@pytest.mark.parametrize("size", [(65, 97), (224, 224)])
def test_training_gradients_match_reference(size, device):
    # Train mode, grad enabled: every memory-saving backward (attention with
    # recomputed probabilities, norm+linear, GELU+linear, window gathers) against autograd
    # through mmdet's plain modules.
    from swin_backbone.checkpoint.formats import mmdet_to_ours

    arch = dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 4, 4, 8), window_size=7)
    ref = _reference("mmdet", **arch, drop_path_rate=0.0)
    ref.init_weights()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("relative_position_bias_table") or name.endswith(".bias"):
                p.normal_(std=0.1)
    ours = SwinBackbone(arch=None, **arch, mask_padding=False, drop_path_rate=0.0)
    swin_backbone.load_checkpoint(ours, ref.state_dict(), strict=True)
    # float64: weight gradients sum thousands of tokens, fp32 ordering noise would hide bugs.
    ref.double().to(device).train()
    ours.double().to(device).train()
    x = _inputs(2, size).double().to(device)
    probes = None
    grads = []
    for model in (ref, ours):
        xi = x.clone().requires_grad_(True)
        outs = model(xi)
        probes = probes or [torch.randn_like(o) for o in outs]
        sum((o * p).sum() for o, p in zip(outs, probes)).backward()
        grads.append((outs, xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (ref_outs, ref_xgrad, ref_pgrads), (outs, xgrad, pgrads) = grads
    for e, g in zip(ref_outs, outs):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(xgrad, ref_xgrad)
    converted, _, _ = mmdet_to_ours(ref_pgrads)
    assert set(converted) == set(pgrads)
    for name, g in pgrads.items():
        torch.testing.assert_close(g, converted[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lib", ["mmdet", "mmseg"])
def test_stochastic_depth_draws_as_the_reference(lib):
    # Training with stochastic depth: from one seed, ours drops the samples mmdet's / mmseg's
    # SwinTransformer drops (mmcv's draw, floor(keep + U), at the same calls), so swapping the
    # backbone keeps a seeded run's trajectory. Whole windows (no padding, which mmdet does not
    # mask), training gradients through the dropped branches.
    arch = dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4), window_size=7, out_indices=(0, 1))
    torch.manual_seed(0)
    ref = _reference(lib, **arch, drop_path_rate=0.5)
    ref.init_weights()
    ours = SwinBackbone(arch=None, **arch, drop_path_rate=0.5)
    swin_backbone.load_checkpoint(ours, ref.state_dict(), strict=True)
    ref.train()
    ours.train()
    x = torch.randn(4, 3, 112, 112)
    outs = {}
    for name, model, seed in (("ref", ref, 1), ("ours", ours, 1), ("ours, another seed", ours, 2)):
        torch.manual_seed(seed)
        outs[name] = model(x)
        sum(o.square().mean() for o in outs[name]).backward()
    for e, g in zip(outs["ref"], outs["ours"]):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # (the draws matter: another seed drops other samples)
    assert any((a - b).abs().max() > 1e-2 for a, b in zip(outs["ref"], outs["ours, another seed"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_drop_path_keeps_its_rate_in_every_dtype(dtype):
    # 2M samples (a keep share's spread is 2e-4): the share kept is 1 - rate in every dtype (a
    # draw in bf16 keeps 0.8986 at rate 0.1), the survivors scaled by 1 / keep, in x's dtype.
    from swin_backbone.ops import DropPath

    torch.manual_seed(0)
    out = DropPath(0.1).train()(torch.ones(2_000_000, 1, 1, dtype=dtype))
    assert out.dtype == dtype
    assert abs((out != 0).double().mean().item() - 0.9) < 1e-3
    # (in fp32: torch 2.0 has no CPU unique for fp16)
    assert set(out.float().unique().tolist()) == {0.0, torch.tensor(1 / 0.9, dtype=dtype).float().item()}


def test_full_tiny_parity_batch3():
    ref = _reference("mmdet", drop_path_rate=0.0)
    ref.init_weights()
    ref.eval()
    ours = SwinBackbone("tiny", mask_padding=False).eval()
    swin_backbone.load_checkpoint(ours, ref.state_dict(), strict=True)
    x = _inputs(3, (65, 97))
    with torch.no_grad():
        for e, g in zip(ref(x), ours(x)):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- padding is masked
def _brute_force_block(block, x, ws, shift):
    """One Swin block, attention written token by token over real tokens only."""
    b, h, w, c = x.shape
    attn = block.attn
    nh = attn.num_heads
    d = c // nh
    hp, wp = W.padded_size(h, ws), W.padded_size(w, ws)
    q, k, v = attn.qkv(block.norm1(x)).view(b, h, w, 3, nh, d).unbind(3)
    table = attn.relative_position_bias_table

    def region(pos, padded):
        if shift == 0:
            return 0
        return 0 if pos < padded - ws else (1 if pos < padded - shift else 2)

    def where(hh, ww):  # position in the padded, shifted frame
        r, cc = (hh - shift) % hp, (ww - shift) % wp
        return r, cc, (r // ws, cc // ws), (region(r, hp), region(cc, wp))

    out = torch.zeros(b, h, w, nh, d)
    for i in range(h):
        for j in range(w):
            r, cc, win, reg = where(i, j)
            keys, bias = [], []
            for i2 in range(h):
                for j2 in range(w):
                    r2, c2, win2, reg2 = where(i2, j2)
                    if win2 == win and reg2 == reg:
                        keys.append((i2, j2))
                        dy, dx = r % ws - r2 % ws, cc % ws - c2 % ws
                        bias.append(table[(dy + ws - 1) * (2 * ws - 1) + dx + ws - 1])
            kk = torch.stack([k[:, a, bb] for a, bb in keys], 2)  # (B, nH, K, d)
            vv = torch.stack([v[:, a, bb] for a, bb in keys], 2)
            logits = (q[:, i, j, :, None, :] * attn.scale * kk).sum(-1) + torch.stack(bias, 1)  # (B, nH, K)
            out[:, i, j] = (logits.softmax(-1)[..., None] * vv).sum(2)
    x = x + attn.proj(out.reshape(b, h, w, c))
    return x + block.mlp(block.norm2(x))


def _brute_force_backbone(model, img):
    x = model.patch_embed(img)
    outs = []
    for i, stage in enumerate(model.stages):
        for block in stage.blocks:
            x = _brute_force_block(block, x, stage.window_size, stage.shift_size if block.shift else 0)
        outs.append(getattr(model, f"norm{i}")(x).permute(0, 3, 1, 2))
        if stage.downsample is not None:
            x = stage.downsample(x)
    return outs


@pytest.mark.parametrize("size", [(23, 29), (9, 30)])
def test_padding_is_masked_against_brute_force(size):
    cfg = dict(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.0)
    model = SwinBackbone(**cfg, out_indices=(0, 1), mask_padding=True).eval()
    model.init_weights()
    img = torch.randn(2, 3, *size)
    with torch.no_grad():
        expected = _brute_force_backbone(model, img)
        got = model(img)
        unmasked = SwinBackbone(**cfg, out_indices=(0, 1), mask_padding=False).eval()
        unmasked.load_state_dict(model.state_dict())
        plain = unmasked(img)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    # the padded tokens really do change mmdet-style (unmasked) features
    assert not torch.allclose(plain[0], got[0], atol=1e-4)


# ---------------------------------------------------------------- caching
def test_second_forward_builds_no_mask():
    model = SwinBackbone(**small_arch()).eval()
    x = torch.randn(1, 3, 97, 65)
    with torch.no_grad():
        model(x)
        before = L.get_window_layout.cache_info()
        model(x)
        after = L.get_window_layout.cache_info()
    assert after.misses == before.misses
    assert after.hits > before.hits
    # masks and indices are never part of the state dict
    assert not any("mask" in k or "index" in k for k in model.state_dict())


# ---------------------------------------------------------------- freezing
@pytest.mark.parametrize("frozen", [0, 1, 2, 4])
def test_frozen_stages(frozen):
    model = SwinBackbone(**small_arch(frozen_stages=frozen, use_abs_pos_embed=True))
    model.init_weights()
    model.train()
    frozen_prefixes = ["patch_embed.", "absolute_pos_embed"] + [f"stages.{i}." for i in range(frozen)] + [
        f"norm{i}." for i in range(frozen)
    ]
    outs = model(torch.randn(2, 3, 40, 40))
    if frozen == 4:  # everything frozen: nothing to differentiate
        assert not any(o.requires_grad for o in outs)
        assert not any(p.requires_grad for p in model.parameters())
        return
    sum(o.sum() for o in outs).backward()
    for name, p in model.named_parameters():
        is_frozen = any(name.startswith(pref) for pref in frozen_prefixes)
        assert p.requires_grad == (not is_frozen), name
        assert (p.grad is None) == is_frozen, name
    for i in range(frozen):
        assert not model.stages[i].training
    assert model.patch_embed.training is False
    if frozen < 4:
        assert model.stages[frozen].training
    assert model.train() is model  # train() returns self (chainable)


# ---------------------------------------------------------------- activation checkpointing
def test_checkpointing_gives_same_gradients():
    torch.manual_seed(1)
    plain = SwinBackbone(**small_arch())
    plain.init_weights()
    cp = SwinBackbone(**small_arch(with_cp=True))
    cp.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 45, 37)
    for model in (plain, cp):
        model.train()
        outs = model(x)
        sum((o * o).mean() for o in outs).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), cp.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def _graph_nodes(outputs):
    """Names of every autograd node behind ``outputs``."""
    seen, stack, names = set(), [o.grad_fn for o in outputs], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return names


@pytest.mark.parametrize("rates", [{}, dict(drop_path_rate=0.3, drop_rate=0.1)], ids=["no_dropout", "dropout"])
def test_in_place_residuals_never_write_into_views(rates):
    # A residual added in place into a view makes autograd record a copy into the view's base
    # (CopySlices), whose backward allocates, zero-fills and copies a map-sized gradient.
    model = SwinBackbone(**small_arch(**rates)).train()
    names = _graph_nodes(model(torch.randn(2, 3, 45, 37)))
    assert "AddBackward0" in names  # the residuals are in the graph ...
    assert "CopySlices" not in names and "AsStridedBackward0" not in names  # ... not via views


def test_stochastic_depth_and_dropout_training():
    # Dropped paths, dropout and attention dropout in training: the residuals (added in place
    # into the branch outputs) still backpropagate; eval ignores the rates entirely.
    torch.manual_seed(0)
    rates = dict(drop_path_rate=0.5, drop_rate=0.1, attn_drop_rate=0.1)
    model = SwinBackbone(**small_arch(**rates))
    model.init_weights()
    plain = SwinBackbone(**small_arch())
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 45, 37)
    before = x.clone()
    model.train()
    first = model(x)
    sum((o * o).mean() for o in first).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        again = model(x)
    assert any(not torch.equal(a, b) for a, b in zip(first, again))  # stochastic in training
    model.eval()
    plain.eval()
    with torch.no_grad():
        for a, b in zip(model(x), plain(x)):
            torch.testing.assert_close(a, b)
    assert torch.equal(x, before)  # the input is never written to


# ---------------------------------------------------------------- precision
def test_bf16_autocast_and_pure_bf16():
    model = SwinBackbone(**small_arch()).eval()
    model.init_weights()
    x = torch.randn(2, 3, 61, 75)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(x)
        pure = model.to(torch.bfloat16)(x.bfloat16())
    for r, a, p in zip(ref, amp, pure):
        assert torch.isfinite(a).all() and torch.isfinite(p).all()
        assert p.dtype == torch.bfloat16
        assert (a.float() - r).abs().mean() < 0.1 * r.abs().mean()
        assert (p.float() - r).abs().mean() < 0.1 * r.abs().mean()


def test_bf16_autocast_training_step():
    model = SwinBackbone(**small_arch())
    model.init_weights()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = model(torch.randn(2, 3, 50, 50))
    loss = sum(o.float().square().mean() for o in outs)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fp16_model_runs_on_cpu():
    model = SwinBackbone(**small_arch()).eval()
    model.init_weights()
    x = torch.randn(1, 3, 47, 53)
    with torch.no_grad():
        ref = model(x)
        try:
            half = model.half()(x.half())
        except (RuntimeError, NotImplementedError) as err:  # pragma: no cover - CPU without fp16 kernels
            pytest.skip(f"fp16 kernels unavailable on this CPU: {err}")
    for r, h in zip(ref, half):
        assert h.dtype == torch.float16 and torch.isfinite(h).all()
        assert (h.float() - r).abs().mean() < 0.05 * r.abs().mean()


# ---------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(arch="huge"), "arch"),
        (dict(arch=None, embed_dims=96, depths=(2, 2), num_heads=(5, 6)), r"num_heads\[0\]"),
        (dict(out_indices=(0, 4)), "out_indices"),
        (dict(out_indices=()), "out_indices"),
        (dict(frozen_stages=5), "frozen_stages"),
        (dict(frozen_stages=-2), "frozen_stages"),
        (dict(window_size=-1), "window_size"),
        (dict(window_size=0), "window_size"),
        (dict(patch_size=0), "patch_size"),
        (dict(drop_path_rate=1.5), "drop_path_rate"),
        (dict(arch=None, embed_dims=32), "depths"),
        (dict(arch=None, embed_dims=32, depths=(2, 2), num_heads=(2,)), "num_heads"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SwinBackbone(**kwargs)


@pytest.mark.parametrize(
    "x,match",
    [
        (torch.randn(3, 32, 32), "4-D"),
        (torch.randn(1, 1, 3, 32, 32), "4-D"),
        (torch.randn(1, 4, 32, 32), "3 channels"),
        (torch.randn(1, 32, 32, 3), "NHWC"),
        (torch.randn(0, 3, 32, 32), ">= 1"),
        (torch.randn(1, 3, 0, 32), ">= 1"),
        (torch.randint(0, 255, (1, 3, 32, 32), dtype=torch.uint8), "floating-point"),
        (torch.randn(1, 3, 32, 32, dtype=torch.float64), "dtype"),
        ([[1.0]], "torch.Tensor"),
    ],
)
def test_bad_input_raises(x, match):
    model = SwinBackbone(**small_arch()).eval()
    with pytest.raises(ValueError, match=match):
        model(x)


@pytest.mark.slow  # (a fresh interpreter)
def test_package_imports_without_mmdet_and_mmseg():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['mmdet'] = None; sys.modules['mmseg'] = None; sys.modules['mmpretrain'] = None\n"
        "import torch, swin_backbone\n"
        "assert swin_backbone.REGISTERED_IN == [], swin_backbone.REGISTERED_IN\n"
        "m = swin_backbone.SwinBackbone(arch=None, embed_dims=16, depths=(1, 1), num_heads=(1, 2), out_indices=(1,))\n"
        "print(tuple(m(torch.randn(1, 3, 20, 20))[0].shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "(1, 32, 3, 3)"  # (after mmengine's log lines, if any)


def test_batch_members_are_independent():
    # Each image of a batch gets exactly the features it gets alone (fused per-image path,
    # plain path and mask-free blocks alike).
    model = SwinBackbone(**small_arch()).eval()
    model.init_weights()
    x = torch.randn(3, 3, 45, 61)
    with torch.no_grad():
        together = model(x)
        for i in range(3):
            alone = model(x[i : i + 1])
            for t, a in zip(together, alone):
                torch.testing.assert_close(t[i : i + 1], a, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- modules on their own
def _small_model(version):
    """A two-stage V1 / V2 model with non-trivial parameters (eval mode)."""
    from swin_backbone import SwinV2Backbone

    cls = SwinBackbone if version == "v1" else SwinV2Backbone
    torch.manual_seed(0)
    model = cls(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.0,
                out_indices=(0, 1))
    model.init_weights()
    return randomize(model)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("train", [False, True])
def test_modules_called_on_their_own_work(version, train):
    # A block, WindowAttention, stage or merging called on its own (as other code may call
    # them) with the plan ops.plan_for makes for that module: the results equal those under
    # the backbone's plan, with gradients in training.
    from swin_backbone import ops
    from swin_backbone.ops.layouts import get_window_layout

    model = _small_model(version).train(train)
    stage = model.stages[0]
    block, merging = stage.blocks[1], stage.downsample
    x = torch.randn(2, 9, 11, 16, requires_grad=train)
    with torch.set_grad_enabled(train):
        plan = ops.plan_stages(x, model)[0]  # (stage 0's, as the backbone plans it)
        layout = get_window_layout(9, 11, 4, 2, True, x.device, x.dtype, False, False, 4)
        tokens = x.reshape(2, 99, 16)
        norm = block.norm1 if version == "v1" else torch.nn.Identity()  # (V1 normalises attention's input, V2 its output)

        def bound(p):
            return dataclasses.replace(layout, plan=p)

        calls = {
            "attention": (block.attn, tokens, lambda p: block.attn(norm(tokens), bound(p))),
            "block": (block, tokens, lambda p: block(tokens, bound(p))),
            "stage": (stage, x, lambda p: stage(x, p)),
            "merging": (merging, x, lambda p: merging(x)),  # (no plan: merging reads no sizes)
        }
        for name, (module, inputs, call) in calls.items():
            alone, planned = call(ops.plan_for(inputs, module)), call(plan)
            torch.testing.assert_close(alone, planned, msg=name)
            assert torch.isfinite(alone).all(), name
            if train:
                (g_alone,) = torch.autograd.grad(alone.square().sum(), x)
                (g_planned,) = torch.autograd.grad(planned.square().sum(), x)
                torch.testing.assert_close(g_alone, g_planned, msg=name)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_modules_called_on_their_own_work_on_the_meta_device(version):
    # Shapes only (meta tensors hold no data): every module runs there on its own.
    from swin_backbone import ops
    from swin_backbone.ops.layouts import get_window_layout

    model = _small_model(version).to("meta").eval()
    stage = model.stages[0]
    x = torch.empty(2, 9, 11, 16, device="meta")
    layout = get_window_layout(9, 11, 4, 2, True, x.device, x.dtype, False, False, 4)
    tokens = x.reshape(2, 99, 16)
    norm = stage.blocks[1].norm1 if version == "v1" else torch.nn.Identity()  # (V1 normalises attention's input)
    attn, block = stage.blocks[1].attn, stage.blocks[1]
    assert attn(norm(tokens), dataclasses.replace(layout, plan=ops.plan_for(tokens, attn))).shape == (2, 99, 16)
    assert block(tokens, dataclasses.replace(layout, plan=ops.plan_for(tokens, block))).shape == (2, 99, 16)
    assert stage(x, ops.plan_for(x, stage)).shape == (2, 9, 11, 16)
    assert stage.downsample(x).shape == (2, 5, 6, 32)
    assert [tuple(o.shape) for o in model(torch.empty(1, 3, 36, 44, device="meta"))] == [(1, 16, 9, 11), (1, 32, 5, 6)]


@pytest.mark.parametrize("context", ["torch.device", "mmengine", "parameters_on_meta"])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_built_on_the_meta_device_then_loaded_computes_as_built_normally(version, context):
    # Large models are built without values (torch's meta-device context; mmengine's
    # MetaTensorContext, which FSDPStrategy's skip_init_weights uses; SwinFSDPStrategy's
    # parameters_on_meta), given memory and loaded: the features and the shapes of a training
    # step on meta are those of the model built normally.
    from mmengine._strategy.utils import MetaTensorContext

    from swin_backbone import SwinV2Backbone
    from swin_backbone.mmlab.fsdp import parameters_on_meta

    cls = SwinBackbone if version == "v1" else SwinV2Backbone
    arch = dict(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.3,
                out_indices=(0, 1))
    reference = _small_model(version)
    contexts = {"torch.device": lambda: torch.device("meta"), "mmengine": MetaTensorContext,
                "parameters_on_meta": parameters_on_meta}
    with contexts[context]():
        model = cls(**arch)
    assert {t.device.type for t in model.state_dict().values()} == {"meta"}
    assert [b.drop_path.drop_prob for b in model.stages[1].blocks] == pytest.approx(torch.linspace(0, 0.3, 4)[2:].tolist())
    outs = model.train()(torch.empty(2, 3, 36, 44, device="meta"))
    sum(o.sum() for o in outs).backward()
    assert [tuple(o.shape) for o in outs] == [(2, 16, 9, 11), (2, 32, 5, 6)]
    model.to_empty(device="cpu")
    swin_backbone.load_checkpoint(model, reference.state_dict(), strict=True)
    x = torch.randn(2, 3, 36, 44)
    for got, expected in zip(model.eval()(x), reference(x)):
        assert torch.equal(got, expected)
