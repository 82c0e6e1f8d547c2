"""Swin V2's post-norm block (its MLP half by row chunks in CPU inference) and cosine attention
inputs give the plain modules' values and gradients on every path the plan names (lean saves,
the norm and GELU outputs rebuilt in backward, are tested for pre-norm V1 and post-norm V2
blocks alike in test_memory.py)."""
import dataclasses

import pytest
import torch

from swin_backbone import ops
from swin_backbone.model.v2 import SwinBlockV2


def _block(c=8, hidden=32, dtype=torch.float64, drop_rate=0.0):
    torch.manual_seed(0)
    block = SwinBlockV2(c, 2, 4, shift=False, mlp_ratio=hidden / c, drop_rate=drop_rate).to(dtype)
    with torch.no_grad():  # non-trivial affine parameters
        block.norm2.weight.normal_(1, 0.3)
        block.norm2.bias.normal_(0, 0.3)
    return block


def _layout(tokens, height, width, plan):
    """The regular layout of a ``height x width`` map of ``tokens`` (``(B, H * W, C)``), bound to
    ``plan``, as a stage gives it to its blocks (rows sized by the MLP's hidden width, 32)."""
    grid = torch.empty(tokens.shape[0], height, width, 1, dtype=tokens.dtype)
    regular, _ = ops.stage_layouts(grid, plan, window_size=4, shift_size=0, pad_small_map=True, mask_padding=True,
                                   row_width=32)
    return regular


def _reference(block, x, layout):
    """The post-norm block written out with its modules: ``x + drop_path(norm1(attn(x)))``, then
    ``+ drop_path(norm2(mlp(x)))``, whole tensors."""
    whole = dataclasses.replace(layout, row_chunks=None)
    x = x + block.drop_path(block.norm1(block.attn(x, whole)), whole)
    return x + block.drop_path(block.norm2(block.mlp(x)), whole)


def test_post_norm_block_in_pure_bf16():
    block = _block(dtype=torch.bfloat16)
    x = torch.randn(2, 5 * 6, 8, dtype=torch.bfloat16, requires_grad=True)
    ref = _reference(block, x, _layout(x, 5, 6, ops.plan_for(x, grad=True, save_memory=False)))
    params = [x, block.norm2.weight]
    ref_grads = torch.autograd.grad(ref.float().sum(), params)
    for save_memory in (True, False):
        plan = ops.plan_for(x, grad=True, save_memory=save_memory, exact_modules=True)
        with ops.LEAN_SAVES[plan.save_memory]:
            out = block(x, _layout(x, 5, 6, plan))
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
        for a, b in zip(torch.autograd.grad(out.float().sum(), params), ref_grads):
            torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("situation", ["inference", "training", "dropout"])
def test_the_post_norm_block_runs_by_plan(situation):
    # The forward's plan for each situation: CPU inference runs the MLP half by row chunks,
    # added in place; training (with or without dropout) keeps no norm / GELU output; all give
    # the modules' values and gradients.
    block = _block(drop_rate=0.3 if situation == "dropout" else 0.0).train(situation == "dropout")
    grad = situation != "inference"
    x = torch.randn(2, 5 * 6, 8, dtype=torch.float64, requires_grad=grad)
    with ops.override(chunk_bytes=4096), torch.set_grad_enabled(grad):  # (2 * 30 rows of 32 fp64: 4 chunks)
        plan = ops.plan_for(x, block)
        layout = _layout(x, 5, 6, plan)
    assert plan.grad == grad and plan.exact_modules == (situation != "dropout")  # (dropout: modules not plain)
    chunked = plan.exact_modules and not plan.grad and plan.chunk_bytes > 0
    assert chunked == (situation == "inference") and plan.save_memory == grad
    assert layout.plan is plan
    assert (layout.row_chunks is not None) == chunked and (not chunked or len(layout.row_chunks) == 4)
    with torch.set_grad_enabled(grad):
        torch.manual_seed(1)
        ref = _reference(block, x, layout)
        torch.manual_seed(1)
        tokens = x.detach().clone() if situation == "inference" else x * 1
        with ops.LEAN_SAVES[plan.save_memory]:
            got = block(tokens, layout)
    torch.testing.assert_close(got, ref)
    if situation == "inference":  # (the MLP's rows are added into the block's own sum, not into its input)
        assert got.grad_fn is None and got.data_ptr() != tokens.data_ptr() and torch.equal(tokens, x)
        return
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(gx, rx)
    whole = dataclasses.replace(layout, plan=dataclasses.replace(plan, save_memory=False))
    torch.manual_seed(1)
    torch.testing.assert_close(block(x * 1, whole), got)


def _reference_cosine_qkv(qkv, logit_scale, num_heads):
    """The plain expression: normalised q and k (F.normalize), q times the clamped scale."""
    heads = qkv.reshape(*qkv.shape[:-1], 3, num_heads, -1)
    acc = torch.promote_types(qkv.dtype, torch.float32)
    scale = torch.clamp(logit_scale.reshape(num_heads, 1).to(acc), max=ops.cosine.LOGIT_SCALE_MAX).exp()
    q = torch.nn.functional.normalize(heads[..., 0, :, :].to(acc), dim=-1) * scale
    k = torch.nn.functional.normalize(heads[..., 1, :, :].to(acc), dim=-1)
    return torch.stack((q.to(qkv.dtype), k.to(qkv.dtype), heads[..., 2, :, :]), dim=-3).reshape(qkv.shape)


def _cosine_plans(qkv):
    """The plans cosine_qkv distinguishes: none (plain ops), inference (in place), inference with
    modules that are not plain (a hook may hold qkv: plain ops), training (memory-saving
    function), training without memory-saving functions (plain ops)."""
    inference = ops.plan_for(qkv, grad=False, exact_modules=True)
    training = ops.plan_for(qkv, grad=True, save_memory=True)  # (the memory-saving function needs no torch feature)
    assert not inference.grad and training.grad and training.save_memory
    return {"none": None, "inference": inference, "inference_watched": ops.plan_for(qkv, grad=False),
            "training": training, "training_plain": ops.plan_for(qkv, grad=True, save_memory=False)}


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
