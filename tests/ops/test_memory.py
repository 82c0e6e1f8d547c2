"""The planner's memory and cache savings compute what plain autograd and whole tensors compute.

* Training (``plan.save_memory``): under ``ops.LEAN_SAVES[True]`` autograd keeps no LayerNorm or GELU
  output (nor the window gather of a norm's output); backward rebuilds them from what their own
  nodes keep: same values and gradients as plain autograd (pre-norm V1 and post-norm V2 branches,
  partial ``requires_grad``, dropout, bf16 autocast), with fewer activations kept.
* CPU inference with exact modules (``plan.exact_modules``, no grad, ``chunk_bytes``): a block's MLP
  residual (by the layout's ``row_chunks``) and the output norms run by row chunks, in place:
  same values as whole tensors. A hook or a replaced module turns
  the chunks off (the hook sees the whole tensor once).
"""
import dataclasses
import itertools

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from swin_backbone import SwinBackbone, SwinV2Backbone, ops
from swin_backbone.model.blocks import SwinBlock
from swin_backbone.ops import DropPath
from swin_backbone.model.v2 import SwinBlockV2
from swin_backbone.ops import attention as regions  # (lean saves live beside the gathers they rebuild)
from swin_backbone.ops import layouts
from swin_backbone.torch_compat import autocast_enabled

from ..helpers import small_arch

VERSIONS = {"v1": SwinBlock, "v2": SwinBlockV2}  # pre-norm (norm2 -> MLP) and post-norm (MLP -> norm2)


def _block(version, dtype=torch.float64, c=8, hidden=32):
    """A real block (``c`` channels, MLP width ``hidden``) with non-trivial norm and MLP parameters."""
    torch.manual_seed(0)
    block = VERSIONS[version](c, 2, 4, shift=False, mlp_ratio=hidden / c).to(dtype)
    with torch.no_grad():
        block.norm2.weight.normal_(1, 0.3)
        block.norm2.bias.normal_(0, 0.3)
        block.mlp.fc1.bias.normal_(0, 0.3)
    return block


def _plain_branch(block, x):
    """The MLP branch written out with the block's modules."""
    mlp = block.mlp
    if isinstance(block, SwinBlockV2):
        return block.norm2(mlp.fc2(mlp.act(mlp.fc1(x))))
    return mlp.fc2(mlp.act(mlp.fc1(block.norm2(x))))


def _residual(block, x, save_memory):
    """The block's MLP residual, as its forward computes it, under the stage's lean saves."""
    plan = ops.plan_for(x, grad=True, save_memory=save_memory)
    with ops.LEAN_SAVES[plan.save_memory]:  # (as a stage runs its blocks)
        branch = block.norm2(block.mlp(x)) if isinstance(block, SwinBlockV2) else block.mlp(block.norm2(x))
        return x + block.drop_path(branch)


def test_row_chunks_cover_every_row_once_in_as_few_chunks_as_the_budget_allows():
    # Over a grid of row counts, row sizes and budgets (0: whole tensors): the chunks are the
    # rows in order, each once, none empty (one empty chunk for no rows); as even as possible;
    # each within the budget, or over it by less than a row (rows do not split, and even
    # chunks round up); and no chunk more than needed: one chunk fewer could not hold every byte
    # within the budget, which any chunking must respect.
    for total, row_bytes, budget in itertools.product((0, 1, 2, 3, 7, 10, 64, 1000, 2048), (1, 3, 8, 100),
                                                      (0, 1, 8, 20, 24, 80, 100, 4096, 65536)):
        case = dict(total=total, row_bytes=row_bytes, budget=budget)
        parts = layouts.row_chunks(total, row_bytes, budget)
        rows = [list(range(total)[p]) for p in parts]
        assert [i for chunk in rows for i in chunk] == list(range(total)), case
        assert all(rows) or (total == 0 and len(parts) == 1), case
        sizes = [len(chunk) for chunk in rows]
        assert max(sizes) - min(sizes) <= 1, case
        if budget == 0:
            assert len(parts) == 1, case
            continue
        assert all(size * row_bytes < budget + row_bytes for size in sizes), case
        if row_bytes > budget:
            assert max(sizes) <= 1, case  # a row over the budget: one row each
        assert (len(parts) - 1) * budget < total * row_bytes or len(parts) == 1, case


# ------------------------------------------------------------ training: no norm / GELU output kept
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_memory_saving_mlp_residual_matches_autograd(version):
    block = _block(version)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    params = [x, *block.norm2.parameters(), *block.mlp.parameters()]
    ref = x + _plain_branch(block, x)
    probe = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, params, probe)
    for save_memory in (True, False):
        out = _residual(block, x, save_memory)
        torch.testing.assert_close(out, ref)
        for a, b in zip(torch.autograd.grad(out, params, probe), ref_grads):
            torch.testing.assert_close(a, b)
    with torch.no_grad():
        assert _residual(block, x, True).grad_fn is None
    for p in block.parameters():
        p.requires_grad_(False)
    frozen = _residual(block, x.detach(), True)
    assert frozen.grad_fn is None
    torch.testing.assert_close(frozen, ref.detach())


@pytest.mark.parametrize("frozen", ["mlp", "norm", "input_and_fc1"])
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_memory_saving_partial_gradients(version, frozen):
    # Frozen parameters / an input without grad: only the gradients that are asked for, equal.
    block = _block(version)
    groups = {"mlp": list(block.mlp.parameters()), "norm": list(block.norm2.parameters()),
              "input_and_fc1": [block.mlp.fc1.weight]}
    for p in groups[frozen]:
        p.requires_grad_(False)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=frozen != "input_and_fc1")
    params = [p for p in (x, *block.norm2.parameters(), *block.mlp.parameters()) if p.requires_grad]
    ref = x + _plain_branch(block, x)
    out = _residual(block, x, True)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.square().sum(), params), torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("save_memory", [False, True], ids=["keep_saves", "save_memory"])
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_stochastic_depth_drops_whole_samples(version, save_memory):
    # DropPath zeroes a sample's branch, never single tokens: for each sample the MLP residual
    # adds either nothing or something at every token (drop rate 0.5 over 32 samples).
    block = _block(version).train()
    block.drop_path = DropPath(0.5)
    torch.manual_seed(3)
    x = torch.randn(32, 16, 8, dtype=torch.float64, requires_grad=True)
    out = _residual(block, x * 1, save_memory)
    per_sample = ((out - x).abs().amax(-1) > 0).sum(1)  # per sample: tokens the branch changed
    assert set(per_sample.tolist()) <= {0, x.shape[1]}, per_sample.tolist()
    assert 0 < int((per_sample == 0).sum()) < x.shape[0]  # some samples dropped, some kept
    out.sum().backward()
    assert block.mlp.fc1.weight.grad.abs().sum() > 0


VALID = [(32, 32), (32, 20), (20, 32), (24, 24)]  # per-image sizes of a padded 4x3x32x32 batch


@pytest.mark.parametrize("valid_sizes", [None, VALID], ids=["batch", "valid_sizes"])
@pytest.mark.parametrize("cls", [SwinBackbone, SwinV2Backbone])
def test_every_drop_path_of_a_training_backbone_drops_whole_images(cls, valid_sizes):
    # Stochastic depth drops an image's branch, never some of its tokens, at both residual branches
    # of every block (4 images, rate 0.5): a batch's DropPath sees (B, L, C) once per branch; with
    # per-image valid sizes (the images' tokens packed, padding not computed) it sees the packed
    # (1, T, C) and the layout, and drops each image's (1, h_b * w_b, C) independently there too.
    model = cls(**small_arch(drop_path_rate=0.5, pad_small_map=True)).train()
    calls = []

    def check(module, args, out):
        layout = args[1] if len(args) > 1 else None  # (the branch, then the stage's layout)
        packed = layout is not None and layout.image_tokens is not None
        for part in out.split(layout.image_tokens, 1) if packed else (out,):  # (packed: image by image)
            kept = (part != 0).flatten(1).any(1)
            assert torch.equal(part[~kept], torch.zeros_like(part[~kept]))  # a dropped image: all zeros
            calls.append((tuple(part.shape[:2]), kept.tolist() if module.drop_prob > 0 else []))

    for m in model.modules():
        if isinstance(m, DropPath):
            m.register_forward_hook(check)
    torch.manual_seed(0)
    model(torch.randn(4, 3, 32, 32), valid_sizes=valid_sizes)
    sites = 2 * sum(model.depths)  # (the first block's rate is 0: its DropPath returns its input)
    if valid_sizes is None:
        assert [shape[0] for shape, _ in calls] == [4] * sites
        kept = [k for _, ks in calls for k in ks]
    else:
        expected = []
        for i, sizes in enumerate(ops.image_sizes.stage_valid_sizes(tuple(VALID), 4, len(model.depths))):
            side = 8 >> i  # (the stage's map: where every image fills it, the batch is not packed)
            per_branch = [(4, side * side)] if set(sizes) == {(side, side)} else [(1, h * w) for h, w in sizes]
            expected += per_branch * (2 * model.depths[i])
        assert [shape for shape, _ in calls] == expected
        kept = [k for _, ks in calls for k in ks]
    assert len(calls) and 0.25 < sum(kept) / len(kept) < 0.75  # about half of the images' branches kept


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_memory_saving_replays_dropout_and_stochastic_depth(version):
    # Dropout and stochastic depth are not rebuilt (only norms, GELU and gathers are): backward
    # uses the forward's masks and dropped paths, gradients equal plain autograd's.
    torch.manual_seed(0)
    block = VERSIONS[version](8, 2, 4, shift=False, drop_rate=0.3, drop_path_rate=0.5).double().train()
    x = torch.randn(4, 5, 8, dtype=torch.float64, requires_grad=True)
    params = [x, *block.parameters()]
    results = []
    for save_memory in (True, False):
        torch.manual_seed(1)
        out = _residual(block, x, save_memory)
        grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref)
    assert not torch.equal(out, x + _plain_branch(block.eval(), x))  # dropout really acted
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_memory_saving_under_bf16_autocast(version):
    block = _block(version, dtype=torch.float32)
    x = torch.randn(2, 5, 8, requires_grad=True)
    params = [x, block.mlp.fc1.weight, block.mlp.fc2.weight, block.mlp.fc2.bias, block.norm2.weight]
    results = []
    for save_memory in (True, False):
        # Separate autocast regions: torch < 2.4 reuses a weight cast made without grad for a
        # later use with grad in the same region.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _residual(block, x, save_memory)
        results.append((out, torch.autograd.grad(out.float().sum(), params)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        branch = _plain_branch(block, x)
    (out, grads), (ref, ref_grads) = results
    assert branch.dtype == torch.bfloat16 and out.dtype == ref.dtype == torch.float32  # (an fp32 residual stream)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(out, branch.float() + x, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


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


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_memory_saving_with_fp32_norm_on_bf16_tokens_under_autocast(version, monkeypatch):
    # The mixed case itself (bf16 tokens, fp32 LayerNorm, CUDA's fp32 LayerNorm rule): x is
    # kept in bf16, its gradient comes back in bf16, the parameters' in fp32.
    _layer_norm_in_fp32_under_autocast(monkeypatch)
    block = _block(version, dtype=torch.float32)
    x = torch.randn(2, 5, 8).bfloat16().requires_grad_()
    params = [x, *block.norm2.parameters(), *block.mlp.parameters()]
    results = []
    for save_memory in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _residual(block, x, save_memory)
        results.append((out, torch.autograd.grad(out.float().sum(), params)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_memory_saving_keeps_fewer_activations(version):
    # Plain autograd keeps every activation of the branch until backward; lean saves keep the
    # matmul output (fc1's) and rebuild the LayerNorm's and GELU's in backward (their outputs are
    # freed after the forward).
    block = _block(version).eval()  # (dropout as identity: fc2 reads GELU's output itself)
    outputs = {}

    def watch(name):
        def hook(module, args, out):
            outputs[name] = StorageWeakRef(out.untyped_storage())  # (no reference kept)
        return hook

    names = ("norm2", "mlp.fc1", "mlp.act") if version == "v1" else ("mlp.fc1", "mlp.act")  # (V2: norm2 is the output)
    for name in names:
        block.get_submodule(name).register_forward_hook(watch(name))
    x = torch.randn(2, 64, 8, dtype=torch.float64, requires_grad=True)
    kept = {}
    for save_memory in (True, False):
        out = _residual(block, x, save_memory)
        kept[save_memory] = {name: not ref.expired() for name, ref in outputs.items()}
        out.sum().backward()
        del out
    assert kept[False] == {name: True for name in names}
    assert kept[True] == {name: name == "mlp.fc1" for name in names}


def test_memory_saving_keeps_only_qkv_of_the_attention_input():
    # The attention's input side qkv(windows(norm1(x))) under lean saves keeps the qkv
    # projection (which the attention keeps anyway), not the gathered windows it reads.
    from swin_backbone.ops.layouts import build_window_layout

    block = _block("v1").eval()
    layout = build_window_layout(9, 10, 4, 2, True, torch.device("cpu"), torch.float64)
    watched = {}
    block.attn.qkv.register_forward_hook(lambda m, args, out: watched.update(
        windows=StorageWeakRef(args[0].untyped_storage()), qkv=StorageWeakRef(out.untyped_storage())))
    x = torch.randn(2, 90, 8, dtype=torch.float64, requires_grad=True)
    kept, grads = {}, {}
    for save_memory in (True, False):
        plan = ops.plan_for(x, grad=True, save_memory=save_memory, attention="recompute")
        with ops.LEAN_SAVES[plan.save_memory]:
            out = block.attn(block.norm1(x), dataclasses.replace(layout, plan=plan))
        kept[save_memory] = {name: not ref.expired() for name, ref in watched.items()}
        grads[save_memory] = torch.autograd.grad(out.square().sum(), [x, *block.parameters()], allow_unused=True)
        del out
    assert kept == {True: {"windows": False, "qkv": True}, False: {"windows": True, "qkv": True}}
    for a, b in zip(*grads.values()):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


class _OpCounter(TorchDispatchMode):
    """Counts calls of one aten operator (also those the autograd engine makes in backward)."""

    def __init__(self, op):
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("rule", ["cpu", "cuda"])
def test_memory_saving_serves_autocast_training(rule, version, monkeypatch):
    # Under bf16 autocast the residual stream is bf16 while the norms' parameters are fp32:
    # every block's GELU output and every norm output before a linear are still rebuilt in
    # backward (one GELU per block there, not kept in the forward), with the LayerNorm in the dtype autocast gives it
    # (the input's on the CPU, fp32 on CUDA), and values and gradients equal plain autograd's.
    if rule == "cuda":
        _layer_norm_in_fp32_under_autocast(monkeypatch)
    torch.manual_seed(0)
    model = (SwinBackbone if version == "v1" else SwinV2Backbone)(
        arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.0,
        out_indices=(0, 1))
    x = torch.randn(2, 3, 40, 36)
    results = []
    for save_memory in (True, False):
        model.zero_grad()
        with ops.override(save_memory=save_memory), torch.autocast("cpu", dtype=torch.bfloat16):
            outs = model(x)
        loss = sum(o.float().square().mean() for o in outs)
        with _OpCounter(torch.ops.aten.gelu.default) as recomputed, \
                _OpCounter(torch.ops.aten.addcmul.default) as norms:
            loss.backward()
        assert recomputed.count == (4 if save_memory else 0), (save_memory, recomputed.count)
        # V1's norms before a linear (2 per block, the merging's, ...) rebuilt under both rules:
        # under CUDA's, what the linear keeps is autocast's bf16 cast of the fp32 norm output.
        # (V2's norms come after their linears: nothing keeps their outputs.)
        assert norms.count == (10 if save_memory and version == "v1" else 0), (save_memory, norms.count)
        results.append([o.float() for o in outs] + [p.grad.float() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_training_graph_can_be_walked_twice(version):
    # A training forward's graph serves two backward passes (retain_graph=True) with memory
    # saving off, as plain autograd's does: the second adds the same gradients again. With it
    # on (the default on the CPU) too: the rebuilt outputs come from saved tensors the first
    # backward keeps with retain_graph.
    torch.manual_seed(0)
    model = (SwinBackbone if version == "v1" else SwinV2Backbone)(
        arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.0,
        out_indices=(0, 1)).double()
    x = torch.randn(1, 3, 24, 20, dtype=torch.float64)
    for save_memory in (False, True):
        model.zero_grad()
        with ops.override(save_memory=save_memory):
            loss = sum(o.square().mean() for o in model(x))
        loss.backward(retain_graph=True)
        once = [p.grad.clone() for p in model.parameters()]
        loss.backward()
        for a, b in zip(once, model.parameters()):
            torch.testing.assert_close(b.grad, 2 * a)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_functional_call_gets_the_gradients_of_its_own_parameters(version):
    # torch.func.functional_call swaps tensors in for one call: a recomputation in backward
    # must not read the module's own parameters instead. Gradients w.r.t. the swapped-in
    # tensors equal those of a model that holds them.
    from torch.func import functional_call

    kw = dict(arch=None, embed_dims=16, depths=(2, 2), num_heads=(2, 4), window_size=4, drop_path_rate=0.0,
              out_indices=(0, 1))
    cls = SwinBackbone if version == "v1" else SwinV2Backbone
    torch.manual_seed(0)
    model, holder = cls(**kw).double().train(), cls(**kw).double().train()
    swapped = {n: (p.detach() * 1.1 + 0.01).requires_grad_() for n, p in model.named_parameters()}
    holder.load_state_dict({n: t.detach() for n, t in swapped.items()}, strict=False)
    x = torch.randn(1, 3, 24, 20, dtype=torch.float64)
    outs = functional_call(model, swapped, (x,))
    grads = torch.autograd.grad(sum(o.square().mean() for o in outs), list(swapped.values()))
    ref_outs = holder(x)
    ref_grads = torch.autograd.grad(sum(o.square().mean() for o in ref_outs), list(holder.parameters()))
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b)
    for name, a, b in zip(swapped, grads, ref_grads):
        torch.testing.assert_close(a, b, msg=name)


# ---------------------------------------------------------------- CPU inference: row chunks
def _layouts(x, plan, budget=0, hidden=32):
    """A ``(B, H, W, C)`` map's unshifted layout bound to ``plan``, with row chunks of ``budget``
    bytes of ``hidden``-wide rows (``None``: whole tensors)."""
    layout, _ = ops.stage_layouts(x, plan, window_size=4, shift_size=0, pad_small_map=True, mask_padding=True)
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    chunks = tuple(ops.row_chunks(rows, hidden * x.element_size(), budget)) if budget else None
    return dataclasses.replace(layout, row_chunks=chunks)


@pytest.mark.parametrize("version", sorted(VERSIONS))
@pytest.mark.parametrize("size", [(1, 1), (1, 11), (5, 7)])
def test_chunked_mlp_residual_matches_whole_tensors(chunk_budget, size, version):
    # A block's CPU inference MLP residual, Swin V1 (norm first) and V2 (norm after), in place by
    # row chunks (an odd number of rows: a ragged end), equals whole tensors and the formula.
    block = _block(version)
    grid = torch.zeros(2, *size, 8, dtype=torch.float64)
    x = torch.randn(2, size[0] * size[1], 8, dtype=torch.float64)
    plan = ops.plan_for(x, grad=False, exact_modules=True)
    with torch.no_grad():
        whole = block(x, _layouts(grid, plan))
        got = block(x, _layouts(grid, plan, max(chunk_budget, 1)))
        after_attn = x + block.drop_path((block.norm1(block.attn(x, _layouts(grid, plan))) if version == "v2" else
                                          block.attn(block.norm1(x), _layouts(grid, plan))))
        ref = after_attn + _plain_branch(block, after_attn)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(whole, ref)


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_chunked_mlp_residual_under_autocast(version):
    block = _block(version, dtype=torch.float32)
    grid, x = torch.zeros(2, 1, 7, 8), torch.randn(2, 7, 8)
    plan = ops.plan_for(x, grad=False, exact_modules=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = block(x, _layouts(grid, plan))
        got = block(x, _layouts(grid, plan, 3 * 32 * 4))
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("shape", [(2, 5, 7, 8), (1, 1, 3, 8), (1, 0, 3, 8)])
def test_chunked_output_norm_matches_whole_tensors(shape):
    norm = _block("v1").norm2
    x = torch.randn(shape, dtype=torch.float64)
    # two rows a chunk
    chunked = ops.plan_for(x, grad=False, chunk_bytes=8 * 2 * 7 * 8 * 8, exact_modules=True)
    whole = ops.plan_for(x, grad=False, chunk_bytes=0, exact_modules=True)
    with torch.no_grad():
        got = ops.output_nchw(x, norm, False, chunked)
        ref = ops.output_nchw(x, norm, False, whole)
        view = ops.output_nchw(x, norm, True, chunked)
    assert got.is_contiguous() and ref.is_contiguous() and got.dtype == x.dtype
    expected = norm(x).permute(0, 3, 1, 2)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ref, expected)
    torch.testing.assert_close(view, expected)
    assert view.is_contiguous(memory_format=torch.channels_last) or x.numel() == 0


def test_exact_modules_predicate():
    # Chunks and in-place residuals only where every module is exactly what its class
    # computes and nobody watches: any forward hook (module or global, pre or post) or a
    # subclassed module turns them off; training turns chunks off.
    model = SwinBackbone(**small_arch()).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        plan = ops.plan_for(x, model)
    assert plan.exact_modules and not plan.grad and plan.chunk_bytes > 0
    training = ops.plan_for(x, model.train())
    assert training.grad  # training: no row chunks (they run without grad only)
    model.eval()
    fc1 = model.stages[1].blocks[0].mlp.fc1
    for register in (fc1.register_forward_hook, fc1.register_forward_pre_hook,
                     nn.modules.module.register_module_forward_hook,
                     nn.modules.module.register_module_forward_pre_hook):
        handle = register(lambda *args: None)
        with torch.no_grad():
            watched = ops.plan_for(x, model)
        handle.remove()
        assert not watched.exact_modules, register
    with torch.no_grad():
        assert ops.plan_for(x, model).exact_modules  # hooks removed

    class Scaled(nn.Linear):  # an adapter-like subclass: computes something else
        def forward(self, t):
            return super().forward(t) * 2

    old = model.stages[0].blocks[1].mlp.fc2
    model.stages[0].blocks[1].mlp.fc2 = Scaled(old.in_features, old.out_features)
    with torch.no_grad():
        replaced = ops.plan_for(x, model)
    assert not replaced.exact_modules


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_hooked_or_replaced_module_sees_whole_tensors(version):
    # A forward hook on fc1 fires exactly once per block forward, with the whole tensor, and
    # the features equal the chunked ones; a replaced Linear (an adapter) runs on whole tensors too.
    torch.manual_seed(0)
    model = (SwinBackbone if version == "v1" else SwinV2Backbone)(**small_arch(out_indices=(0,))).eval()
    x = torch.randn(2, 3, 32, 28)
    with ops.override(chunk_bytes=3 * 128 * 4), torch.no_grad():  # chunks of 3 rows: many per block
        (ref,) = model(x)
        calls = []
        fc1 = model.stages[0].blocks[1].mlp.fc1
        handle = fc1.register_forward_hook(lambda m, args, out: calls.append(tuple(out.shape)))
        (hooked,) = model(x)
        handle.remove()
        assert calls == [(2, 8 * 7, 128)]  # (the MLP branch runs on the (B, L, C) tokens, once)
        torch.testing.assert_close(hooked, ref)

        seen = []

        class Watching(nn.Linear):
            def forward(self, t):
                seen.append(tuple(t.shape))
                return super().forward(t)

        replacement = Watching(fc1.in_features, fc1.out_features)
        replacement.load_state_dict(fc1.state_dict())
        model.stages[0].blocks[1].mlp.fc1 = replacement
        (replaced,) = model(x)
    assert seen == [(2, 8 * 7, 32)]
    torch.testing.assert_close(replaced, ref)


# ------------------------------------------------------------ lean saves: what is rebuilt
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_rebuilt_norm_and_gelu_outputs_equal_the_forwards(dtype, affine):
    # What backward gets in place of a LayerNorm / GELU output (a rebuild from what its own node
    # keeps) equals the output itself; a view of it (a linear's 2-d view, the merging's (B, H, W,
    # 4C) map seen as rows) is that view of the rebuild.
    torch.manual_seed(0)
    norm = nn.LayerNorm(24, elementwise_affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.normal_(1, 0.3)
            norm.bias.normal_(0, 0.3)
    x = (torch.randn(2, 5, 7, 24) * 3 + 1).to(dtype).requires_grad_()
    out = norm(x)
    # (fp32 / fp64: the same bits as torch 2.14's CPU kernel; within an ulp or so in general)
    tol = dict() if dtype != torch.bfloat16 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(regions._unpack(regions._pack(out)), out, **tol)
    rows = out.view(-1, 24)[3:40]
    packed = regions._pack(rows)
    assert not isinstance(packed, torch.Tensor)  # (rebuilt, not kept)
    torch.testing.assert_close(regions._unpack(packed), rows, **tol)
    # autocast's cast of a norm output before a linear (CUDA: fp32 norm, bf16 linear), as rows
    cast = out.to(torch.bfloat16 if dtype != torch.bfloat16 else torch.float32).view(-1, 24)
    packed = regions._pack(cast)
    assert not isinstance(packed, torch.Tensor)
    rebuilt = regions._unpack(packed)
    assert rebuilt.dtype == cast.dtype
    torch.testing.assert_close(rebuilt, cast, **tol)
    h = torch.randn(3, 50, dtype=dtype, requires_grad=True) * 2
    for approximate in ("none", "tanh"):
        act = nn.functional.gelu(h, approximate=approximate)
        assert torch.equal(regions._unpack(regions._pack(act)), act)


def test_lean_saves_keep_what_they_cannot_rebuild():
    # Kept as they are: a module output a forward hook replaced, a norm output changed in place,
    # a leaf, another op's output. Gradients through a block whose norm2 and act carry such
    # hooks equal plain autograd's.
    x = torch.randn(4, 6, requires_grad=True)
    norm_out = nn.functional.layer_norm(x, (6,))
    for t in (norm_out * 2, norm_out.clone().mul_(2), x, torch.exp(x), (norm_out * 2).bfloat16(),
              norm_out.to("meta")):  # (a cast that moves devices: kept)
        assert regions._pack(t) is t
    block = _block("v1")
    block.norm2.register_forward_hook(lambda m, args, out: out * 0.5)
    block.mlp.act.register_forward_hook(lambda m, args, out: out.mul_(1.5))
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    params = [x, *block.norm2.parameters(), *block.mlp.parameters()]
    ref = torch.autograd.grad(_residual(block, x, False).square().sum(), params)
    got = torch.autograd.grad(_residual(block, x, True).square().sum(), params)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
