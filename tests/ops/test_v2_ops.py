"""Swin V2's post-norm residuals: the memory-saving MLP -> LayerNorm autograd function and the
cosine attention inputs give the plain modules' values and gradients (the row-chunked CPU
inference residual is tested with the pre-norm one in test_recompute.py)."""
import pytest
import torch
from torch import nn

from swin_backbone import ops
from swin_backbone.model.blocks import DropPath, Mlp
from swin_backbone.ops.recompute import _Mlp, mlp


def mlp_norm(x, fc1, fc2, norm, chunk_bytes=0):
    return mlp(x, fc1, fc2, norm, False, chunk_bytes)


def _mlp_norm_modules(c=8, hidden=32, dtype=torch.float64):
    torch.manual_seed(0)
    mlp, norm = Mlp(c, hidden).to(dtype), nn.LayerNorm(c).to(dtype)
    with torch.no_grad():  # non-trivial affine parameters
        norm.weight.normal_(1, 0.3)
        norm.bias.normal_(0, 0.3)
    return mlp, norm


def test_mlp_norm_matches_autograd(chunk_budget):
    mlp, norm = _mlp_norm_modules()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out = mlp_norm(x, mlp.fc1, mlp.fc2, norm, chunk_budget)
    assert out.grad_fn.name() == "_MlpBackward"
    ref = norm(mlp(x))
    torch.testing.assert_close(out, ref)
    params = [x, *mlp.parameters(), *norm.parameters()]
    probe = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, params, probe), torch.autograd.grad(ref, params, probe)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        assert mlp_norm(x, mlp.fc1, mlp.fc2, norm).grad_fn is None


@pytest.mark.parametrize("chunk", [0, 3 * 6 * 8])
def test_mlp_norm_gradcheck(chunk):
    mlp, norm = _mlp_norm_modules(4, 6)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)

    def fn(x, w1, b1, w2, b2, nw, nb):
        return _Mlp.apply(x, w1, b1, w2, b2, nw, nb, norm.eps, False, chunk)

    params = (x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, norm.weight, norm.bias)
    assert torch.autograd.gradcheck(fn, params)


@pytest.mark.parametrize("frozen", ["mlp", "norm", "input_and_fc1"])
def test_mlp_norm_partial_gradients(frozen):
    mlp, norm = _mlp_norm_modules()
    groups = {"mlp": list(mlp.parameters()), "norm": list(norm.parameters()), "input_and_fc1": [mlp.fc1.weight]}
    for p in groups[frozen]:
        p.requires_grad_(False)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=frozen != "input_and_fc1")
    out = mlp_norm(x, mlp.fc1, mlp.fc2, norm, 3 * 32 * 8)
    assert out.grad_fn.name() == "_MlpBackward"
    ref = norm(mlp(x))
    params = [p for p in (x, *mlp.parameters(), *norm.parameters()) if p.requires_grad]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, b)


def test_mlp_norm_under_bf16_autocast():
    mlp, norm = _mlp_norm_modules(dtype=torch.float32)
    x = torch.randn(2, 5, 8, requires_grad=True)
    params = [x, mlp.fc1.weight, mlp.fc2.weight, mlp.fc2.bias, norm.weight, norm.bias]
    # Separate autocast regions: torch < 2.4 reuses a weight cast made inside a Function's
    # forward (no grad) for a later use with grad in the same region.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mlp_norm(x, mlp.fc1, mlp.fc2, norm, 3 * 32 * 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = norm(mlp(x))
    # the LayerNorm's dtype follows autocast's rule for nn.LayerNorm (on the CPU: its input's)
    assert out.grad_fn.name() == "_MlpBackward" and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)  # fc2's bias added after rounding
    for a, b in zip(torch.autograd.grad(out.float().sum(), params), torch.autograd.grad(ref.float().sum(), params)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def test_mlp_norm_in_pure_bf16():
    mlp, norm = _mlp_norm_modules(dtype=torch.bfloat16)
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    out = mlp_norm(x, mlp.fc1, mlp.fc2, norm, 3 * 32 * 2)
    ref = norm(mlp(x))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
    params = [x, norm.weight]
    for a, b in zip(torch.autograd.grad(out.float().sum(), params), torch.autograd.grad(ref.float().sum(), params)):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("situation", ["inference", "training", "dropout"])
def test_ops_routes_the_post_norm_mlp_residual_by_plan(situation):
    mlp, norm = _mlp_norm_modules()
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=situation != "inference")
    plan = ops.plan_for(x, grad=situation != "inference", dropout=situation == "dropout")
    with torch.set_grad_enabled(situation != "inference"):
        ref = x + norm(mlp(x))
        got = ops.mlp_residual(x.detach().clone() if situation == "inference" else x * 1, mlp, norm, False,
                               DropPath(0.0), plan)
    torch.testing.assert_close(got, ref)
    if situation == "inference":
        assert plan.chunk_bytes > 0 and got.grad_fn is None
        return
    backward = got.grad_fn.next_functions[0][0].name()
    # training keeps only the inputs; with dropout active the plain modules run (autograd)
    assert (backward == "_MlpBackward") == (situation == "training")
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(gx, rx)


def _reference_cosine_qkv(qkv, logit_scale, num_heads):
    """The plain expression: normalised q and k (F.normalize), q times the clamped scale."""
    heads = qkv.reshape(*qkv.shape[:-1], 3, num_heads, -1)
    acc = torch.promote_types(qkv.dtype, torch.float32)
    scale = torch.clamp(logit_scale.reshape(num_heads, 1).to(acc), max=ops.cosine.LOGIT_SCALE_MAX).exp()
    q = torch.nn.functional.normalize(heads[..., 0, :, :].to(acc), dim=-1) * scale
    k = torch.nn.functional.normalize(heads[..., 1, :, :].to(acc), dim=-1)
    return torch.stack((q.to(qkv.dtype), k.to(qkv.dtype), heads[..., 2, :, :]), dim=-3).reshape(qkv.shape)


def _cosine_plans(qkv):
    """The plans cosine_qkv distinguishes: none (plain ops), inference (in place), training
    (memory-saving function), training without memory-saving functions (plain ops)."""
    inference = ops.plan_for(qkv, grad=False)
    training = ops.plan_for(qkv, grad=True)
    assert not inference.grad and training.grad and training.save_memory
    return {"none": None, "inference": inference, "training": training,
            "training_plain": ops.plan_for(qkv, grad=True, save_memory=False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cosine_qkv_paths_are_bit_identical_to_the_plain_expression(dtype):
    from swin_backbone.ops.cosine import cosine_qkv

    torch.manual_seed(0)
    qkv = torch.randn(2, 7, 3 * 12).to(dtype)
    qkv[0, 3] = 0  # a zero token (padding): zero q and k stay zero
    scale = torch.tensor([1.0, 5.0, 3.0]).log().view(3, 1, 1)  # one above the clamp
    ref = _reference_cosine_qkv(qkv, scale, 3)
    for name, plan in _cosine_plans(qkv).items():
        mine = qkv.clone()
        with torch.set_grad_enabled(name.startswith("training")):
            out = cosine_qkv(mine, scale, 3, plan)
        assert torch.equal(out, ref), name
        if name == "inference" and dtype != torch.bfloat16:  # written into qkv itself (fp32 / fp64)
            assert out.data_ptr() == mine.data_ptr() and torch.equal(mine, ref)
        else:
            assert torch.equal(mine, qkv), name  # the input untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("plan_name", ["none", "training", "training_plain"])
def test_cosine_qkv_gradients_equal_the_plain_expression(dtype, plan_name):
    from swin_backbone.ops.cosine import cosine_qkv

    torch.manual_seed(0)
    qkv = torch.randn(2, 7, 3 * 12, dtype=dtype)
    qkv[1, 2, :24] = 0  # a zero q and k (padding): F.normalize's gradient there is g / eps
    qkv.requires_grad_()
    scale = torch.tensor([1.0, 5.0, 3.0], dtype=dtype).log().view(3, 1, 1).requires_grad_()  # one above the clamp
    plan = _cosine_plans(qkv)[plan_name]
    probe = torch.randn(2, 7, 36, dtype=dtype)
    out = cosine_qkv(qkv, scale, 3, plan)
    if plan_name == "training":
        assert out.grad_fn.next_functions[0][0].name() == "_CosineQKVBackward"
    got = torch.autograd.grad(out, (qkv, scale), probe)
    ref = torch.autograd.grad(_reference_cosine_qkv(qkv, scale, 3), (qkv, scale), probe)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)
    if dtype == torch.float64:  # (away from the zero token, where F.normalize has a kink)
        x = torch.randn(2, 5, 36, dtype=dtype, requires_grad=True)
        s = torch.rand(3, 1, 1, dtype=dtype).mul(5).requires_grad_()  # some above the clamp
        assert torch.autograd.gradcheck(lambda t, u: cosine_qkv(t, u, 3, plan), (x, s))


def test_memory_saving_cosine_qkv_keeps_only_its_output():
    """Autograd's graph keeps the input and normalised copies; the memory-saving function keeps
    its output (which the attention kernels keep anyway) and per-head norms."""
    from swin_backbone.ops.cosine import cosine_qkv

    qkv = torch.randn(1, 64, 3 * 32, requires_grad=True) * 1
    scale = torch.rand(2, 1, 1, requires_grad=True)
    plans = _cosine_plans(qkv)

    def saved_storages(plan):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = cosine_qkv(qkv, scale, 2, plan)
        return out, seen

    out, seen = saved_storages(plans["training"])
    assert out.untyped_storage().data_ptr() in seen and sum(seen.values()) < 1.1 * out.untyped_storage().nbytes()
    _, plain = saved_storages(plans["training_plain"])
    assert sum(plain.values()) > 1.3 * out.untyped_storage().nbytes()
