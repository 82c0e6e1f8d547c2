"""The memory-saving layer pairs give the plain modules' values and gradients."""
import pytest
import torch
from torch import nn

from swin_backbone.model.blocks import Mlp
from swin_backbone.torch_compat import autocast_enabled
from swin_backbone.ops.chunked import add_by_rows_
from swin_backbone.ops.recompute import _NormLinear, mlp as recompute_mlp, mlp_branch, norm_linear
from swin_backbone.ops.layouts import build_window_layout, window_partition


def _modules(c_in=8, c_out=12, dtype=torch.float64):
    torch.manual_seed(0)
    norm, linear = nn.LayerNorm(c_in).to(dtype), nn.Linear(c_in, c_out).to(dtype)
    with torch.no_grad():  # non-trivial affine parameters
        norm.weight.normal_(1, 0.3)
        norm.bias.normal_(0, 0.3)
    return norm, linear


@pytest.mark.parametrize("size,shift", [(None, 0), ((14, 14), 3), ((9, 12), 3), ((9, 12), 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_norm_linear_matches_modules(size, shift, bias):
    norm, linear = _modules()
    if not bias:
        linear = nn.Linear(8, 12, bias=False).double()
    layout = None
    shape = (2, 5, 8)
    if size is not None:
        layout = build_window_layout(*size, 7, shift, True, torch.device("cpu"), torch.float64)
        shape = (2, size[0] * size[1], 8)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    params = [x, norm.weight, norm.bias, linear.weight] + ([linear.bias] if bias else [])
    out = norm_linear(x, norm, linear.weight, linear.bias, layout)
    assert out.grad_fn.name() == "_NormLinearBackward"
    normed = norm(x)
    ref = linear(normed if layout is None else window_partition(normed, layout))
    torch.testing.assert_close(out, ref)
    probe = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, params, probe), torch.autograd.grad(ref, params, probe)):
        torch.testing.assert_close(a, b)


def test_norm_linear_gradcheck():
    norm, linear = _modules(4, 3)
    layout = build_window_layout(3, 4, 2, 1, True, torch.device("cpu"), torch.float64)
    x = torch.randn(2, 12, 4, dtype=torch.float64, requires_grad=True)

    def fn(x, nw, nb, w, b):
        return _NormLinear.apply(x, nw, nb, norm.eps, w, b, layout)

    assert torch.autograd.gradcheck(fn, (x, norm.weight, norm.bias, linear.weight, linear.bias))


def test_functions_record_nothing_without_grad():
    norm, linear = _modules()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        assert norm_linear(x, norm, linear.weight, linear.bias).grad_fn is None
    for p in (*norm.parameters(), *linear.parameters()):
        p.requires_grad_(False)
    assert norm_linear(x, norm, linear.weight, linear.bias).grad_fn is None
    torch.testing.assert_close(norm_linear(x, norm, linear.weight, linear.bias), linear(norm(x)))


def test_norm_linear_under_bf16_autocast():
    norm, linear = _modules(dtype=torch.float32)
    x = torch.randn(2, 5, 8, requires_grad=True)
    params = [x, norm.weight, linear.weight, linear.bias]
    # Separate autocast regions: torch < 2.4 reuses a weight cast made inside a Function's
    # forward (no grad) for a later use with grad in the same region.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm_linear(x, norm, linear.weight, linear.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = linear(norm(x))
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.float().sum(), params)
    ref_grads = torch.autograd.grad(ref.float().sum(), params)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("with_norm", [False, True])
def test_memory_saving_mlp_matches_autograd(chunk_budget, with_norm):
    torch.manual_seed(0)
    mlp = Mlp(8, 32).double()
    norm, _ = _modules(8, 8)
    norm = norm if with_norm else None
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out = recompute_mlp(x, mlp.fc1, mlp.fc2, norm, True, chunk_budget)
    assert out.grad_fn.name() == "_MlpBackward"
    ref = mlp.fc2(mlp.act(mlp.fc1(x if norm is None else norm(x))))
    torch.testing.assert_close(out, ref)
    params = [x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    params += [] if norm is None else [norm.weight, norm.bias]
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda t, *ps: recompute_mlp(t, mlp.fc1, mlp.fc2, norm, True, chunk_budget), (x, *params[1:]))
    with torch.no_grad():
        assert recompute_mlp(x, mlp.fc1, mlp.fc2, norm, True).grad_fn is None


def test_memory_saving_mlp_partial_gradients():
    # Frozen parameters / an input without grad: only the gradients that are asked for.
    torch.manual_seed(0)
    mlp, (norm, _) = Mlp(8, 32).double(), _modules(8, 8)
    for p in (*norm.parameters(), mlp.fc1.weight):
        p.requires_grad_(False)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    out = recompute_mlp(x, mlp.fc1, mlp.fc2, norm, True, 3 * 32 * 8)
    assert out.grad_fn.name() == "_MlpBackward"
    ref = mlp.fc2(mlp.act(mlp.fc1(norm(x))))
    params = [mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    for a, b in zip(torch.autograd.grad(out.sum(), params), torch.autograd.grad(ref.sum(), params)):
        torch.testing.assert_close(a, b)


def test_memory_saving_mlp_under_bf16_autocast():
    torch.manual_seed(0)
    mlp, norm = Mlp(8, 32), nn.LayerNorm(8)
    x = torch.randn(2, 5, 8, requires_grad=True)
    params = [x, mlp.fc1.weight, mlp.fc2.weight, mlp.fc2.bias, norm.weight]
    # Separate autocast regions: torch < 2.4 reuses a weight cast made inside a Function's
    # forward (no grad) for a later use with grad in the same region.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = recompute_mlp(x, mlp.fc1, mlp.fc2, norm, True, 3 * 32 * 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = mlp.fc2(mlp.act(mlp.fc1(norm(x))))
    assert out.grad_fn.name() == "_MlpBackward" and out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=1e-3)  # bias added after rounding
    for a, b in zip(torch.autograd.grad(out.float().sum(), params), torch.autograd.grad(ref.float().sum(), params)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def _mlp_and_norm(dtype=torch.float64):
    torch.manual_seed(0)
    mlp, norm = Mlp(8, 32).to(dtype), nn.LayerNorm(8).to(dtype)
    with torch.no_grad():  # non-trivial affine parameters
        norm.weight.normal_(1, 0.3)
        norm.bias.normal_(0, 0.3)
    return mlp, norm


def _plain_branch(x, mlp, norm, norm_first):
    return mlp(norm(x)) if norm_first else norm(mlp(x))


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("rows", [0, 1, 10])
def test_chunked_mlp_residual_matches_plain(chunk_budget, rows, norm_first):
    # The CPU inference MLP residual of Swin V1 (norm first) and V2 (norm after), in place by row chunks.
    mlp, norm = _mlp_and_norm()
    x = torch.randn(1, rows, 8, dtype=torch.float64)
    with torch.no_grad():
        ref = x + _plain_branch(x, mlp, norm, norm_first)
        got = add_by_rows_(x, lambda rows: mlp_branch(rows, mlp, norm, norm_first), 32, max(chunk_budget, 1))
    assert got is x  # in place
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_chunked_mlp_residual_under_autocast(norm_first):
    mlp, norm = _mlp_and_norm(torch.float32)
    x = torch.randn(2, 7, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = x + _plain_branch(x, mlp, norm, norm_first)
        got = add_by_rows_(x.clone(), lambda rows: mlp_branch(rows, mlp, norm, norm_first), 32, 3 * 32 * 2)
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("shape", [(2, 5, 7, 8), (1, 1, 3, 8), (1, 0, 3, 8)])
def test_norm_nchw_by_rows_matches_plain(shape):
    from swin_backbone.ops.chunked import norm_nchw_by_rows

    norm, _ = _modules(8, 8)
    x = torch.randn(shape, dtype=torch.float64)
    with torch.no_grad():
        got = norm_nchw_by_rows(x, norm, 8 * 2 * 7 * 8 * 8)  # two rows per chunk
    assert got.is_contiguous()
    torch.testing.assert_close(got, norm(x).permute(0, 3, 1, 2))


@pytest.mark.parametrize("total,step", [(0, 4), (1, 4), (2048, 1365), (32768, 5461), (10, 3), (10, 10), (10, 1)])
def test_chunk_slices_cover_evenly(total, step):
    from swin_backbone.ops.chunked import chunk_slices

    parts = chunk_slices(total, step)
    covered = [i for p in parts for i in range(total)[p]]
    assert covered == list(range(total))  # in order, each once
    sizes = [len(range(total)[p]) for p in parts]
    assert max(sizes) <= step
    assert max(sizes) - min(sizes) <= 1


def _graph_nodes(tensor):
    """Names of every node of ``tensor``'s autograd graph."""
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def _layer_norm_in_fp32_under_autocast(monkeypatch):
    """CUDA's autocast rule on the CPU: LayerNorm computes in fp32 and returns fp32."""
    import torch.nn.functional as F

    real = F.layer_norm

    def layer_norm(x, *args, **kwargs):
        if autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return real(x.float(), *args, **kwargs)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(F, "layer_norm", layer_norm)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("rule", ["cpu", "cuda"])
def test_memory_saving_functions_serve_autocast_training(rule, version, monkeypatch):
    # Under bf16 autocast the residual stream is bf16 while the norms' parameters are fp32:
    # every norm -> qkv / norm -> MLP / merging site still uses the memory-saving functions
    # (with the LayerNorm in the dtype autocast gives it: the input's on the CPU, fp32 on
    # CUDA), and values and gradients equal those of the plain modules.
    from swin_backbone import SwinBackbone, SwinV2Backbone, ops

    if rule == "cuda":
        _layer_norm_in_fp32_under_autocast(monkeypatch)
    torch.manual_seed(0)
    model = (SwinBackbone if version == "v1" else SwinV2Backbone)(
        arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.0,
        out_indices=(0, 1))
    # V1: per block norm -> qkv and norm -> MLP (4 blocks), and stage 1's patch merging;
    # V2: per block the post-norm MLP (its qkv has no norm before it, its merging a norm after).
    expected = {"v1": 9, "v2": 4}[version]
    functions = ("_NormLinearBackward", "_MlpBackward")
    x = torch.randn(2, 3, 40, 36)
    results = []
    for save_memory in (True, False):
        model.zero_grad()
        with ops.override(save_memory=save_memory), torch.autocast("cpu", dtype=torch.bfloat16):
            outs = model(x)
        loss = sum(o.float().square().mean() for o in outs)
        nodes = _graph_nodes(loss)
        fused = sum(n in functions for n in nodes)
        assert fused == (expected if save_memory else 0), (save_memory, fused)
        loss.backward()
        results.append([o.float() for o in outs] + [p.grad.float() for p in model.parameters()])
    # bf16 rounding flips (each path is ~0.1 from fp32 at V2's largest outputs, ~3); torch < 2.4's
    # CPU bf16 kernels round differently (2 of 1600 elements 0.07-0.08 apart on torch 2.0 / 2.1).
    from swin_backbone.torch_compat import torch_version

    atol = 5e-2 if torch_version() >= (2, 4) else 1e-1
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=atol)


def test_norm_linear_with_fp32_norm_on_bf16_tokens_under_autocast(monkeypatch):
    # The mixed case itself (bf16 tokens, fp32 LayerNorm, CUDA's fp32 LayerNorm rule): x is
    # kept in bf16, its gradient comes back in bf16, the parameters' in fp32.
    _layer_norm_in_fp32_under_autocast(monkeypatch)
    norm, linear = _modules(dtype=torch.float32)
    x = torch.randn(2, 5, 8).bfloat16().requires_grad_()
    params = [x, norm.weight, norm.bias, linear.weight, linear.bias]
    # Separate autocast regions: torch < 2.4 reuses a weight cast made inside a Function's
    # forward (no grad) for a later use with grad in the same region.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm_linear(x, norm, linear.weight, linear.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = linear(norm(x))
    assert out.grad_fn.name() == "_NormLinearBackward"
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.float().sum(), params), torch.autograd.grad(ref.float().sum(), params)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
