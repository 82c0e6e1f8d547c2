"""The window-attention implementations (SDPA, plain, CPU recompute) agree, in values and
gradients, with the reference algorithm and with each other, in every backward mode."""
import pytest
import torch

from swin_backbone import ops
from swin_backbone.model.blocks import WindowAttention
from swin_backbone.ops import planner
from swin_backbone.ops.attention import _RecomputedAttention, per_window_bias, sdpa_ready, window_attention
from swin_backbone.ops.layouts import build_window_layout
from swin_backbone.ops.windows import relative_position_index, window_attention_mask

KERNELS = ("sdpa", "plain", "recompute")


def _layout(h, w, shift, mask_padding=True, dtype=torch.float64):
    return build_window_layout(h, w, 7, shift, mask_padding, torch.device("cpu"), dtype)


@pytest.fixture(params=[None, 1, 3], ids=["whole", "1-window-chunks", "3-window-chunks"])
def backward_mode(request):
    """``chunk_bytes`` for the recompute kernel, given one window's logits bytes: whole-tensor
    backward, or 1- and 3-window groups."""

    def settings(window_bytes):
        return 0 if request.param is None else 2 * request.param * window_bytes  # groups take chunk_bytes / 2

    return settings


def _attend(attn, x, layout, kernel, chunk):
    """The attention module's computation (no norm) with a plan forcing these choices."""
    plan = ops.plan_for(x, grad=True, attention=kernel, save_memory=False, chunk_bytes=chunk)
    return attn(x, torch.nn.Identity(), layout, plan)


@pytest.mark.parametrize("size,shift", [((14, 14), 0), ((14, 14), 3), ((9, 12), 0), ((9, 12), 3), ((22, 15), 3)])
@pytest.mark.parametrize("batch", [1, 2])  # SDPA puts per-window biases in its batch (1) or heads (2) dim
def test_kernels_agree_forward_and_backward(size, shift, batch, backward_mode):
    chunk = backward_mode(2 * 4 * 49 * 49 * 8)  # batch x heads x N x N float64
    torch.manual_seed(0)
    attn = WindowAttention(32, 4, 7).double()
    torch.nn.init.normal_(attn.relative_position_bias_table, std=0.5)
    layout = _layout(*size, shift)
    x = torch.randn(batch, size[0] * size[1], 32, dtype=torch.float64)
    grads, outs = {}, {}
    for kernel in KERNELS:
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = _attend(attn, xi, layout, kernel, chunk)
        out.square().sum().backward()
        outs[kernel] = out.detach()
        grads[kernel] = (xi.grad, attn.relative_position_bias_table.grad.clone(), attn.qkv.weight.grad.clone())
    # The reference: plain kernel (one per-window bias), autograd's graph.
    attn.zero_grad()
    xi = x.clone().requires_grad_(True)
    ref = _attend(attn, xi, layout, "plain", 0)
    ref.square().sum().backward()
    ref_grads = (xi.grad, attn.relative_position_bias_table.grad, attn.qkv.weight.grad)
    for kernel in KERNELS:
        torch.testing.assert_close(outs[kernel], ref.detach())
        for a, b in zip(grads[kernel], ref_grads):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("size,shift,mask_padding", [((4, 6), 0, False), ((3, 5), 1, True), ((4, 4), 1, False)])
def test_recompute_kernel_gradcheck(size, shift, mask_padding, backward_mode):
    # The hand-written backward against finite differences, for qkv and the bias, with no
    # mask, with shift + padding masks, and with a shift mask alone.
    torch.manual_seed(0)
    heads, d, window = 2, 3, 2
    chunk = backward_mode(2 * heads * window**4 * 8)
    layout = build_window_layout(*size, window, shift, mask_padding, torch.device("cpu"), torch.float64)
    assert (layout.mask is None) == (shift == 0 and not mask_padding)
    qkv = torch.randn(2, layout.index.numel(), 3 * heads * d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(heads, window**2, window**2, dtype=torch.float64, requires_grad=True)

    plan = ops.plan_for(qkv, grad=True, chunk_bytes=chunk, align_masks=False)

    def fn(qkv, bias):  # (no dropout: the planner runs "plain" for it)
        return _RecomputedAttention.apply(qkv, bias, layout, heads, d**-0.5, plan)

    assert torch.autograd.gradcheck(fn, (qkv, bias))


def test_bad_kernel_arguments_raise():
    qkv = torch.zeros(1, 49, 6)
    with pytest.raises(ValueError, match="attention: expected one of"):
        ops.plan_for(qkv, attention="flash")
    with pytest.raises(ValueError, match="attention: expected one of .*got 'flash'"):
        ops.resolve_attention("flash")


def test_the_removed_triton_kernel_is_a_clear_error(monkeypatch):
    # attention='triton' (the fused kernel, removed without a GPU measurement, issue #47) names the
    # argument, the accepted values, that the kernel was removed and where the reason is written.
    from swin_backbone import SwinBackbone

    removed = (r"\('auto', 'sdpa'\), got 'triton'; the fused Triton kernel was removed "
               r"\(docs/performance.md, \"The fused Triton kernel, removed\"\)")
    tiny = dict(embed_dims=8, depths=(1,), num_heads=(1,), out_indices=(0,))
    with pytest.raises(ValueError, match=r"^attention: expected one of " + removed):
        SwinBackbone(**tiny, attention="triton")
    monkeypatch.setenv(planner.ENV_VAR, "triton")
    with pytest.raises(ValueError, match=r"^SWIN_BACKBONE_ATTENTION: expected one of " + removed):
        SwinBackbone(**tiny)


def test_attention_dropout_always_runs_a_kernel_that_drops():
    # Only the plain kernel applies attention dropout (SDPA's CPU kernels and the recompute
    # kernel's hand-written backward do not): every situation with attention dropout plans it,
    # on every device, eagerly and while tracing.
    f32 = torch.float32
    for device in ("cpu", "cuda"):
        for grad, tracing in ((True, False), (False, False), (True, True), (False, True)):
            plan = planner._decide(device, f32, grad, tracing, True, True, True, planner._SWITCHES)
            assert plan.attention == "plain", (device, grad, tracing, plan.attention)
    # ... and that kernel drops: two training calls differ, and zero attention dropout is deterministic.
    attn = WindowAttention(16, 2, 7)
    layout = _layout(9, 12, 3, dtype=torch.float32)
    x = torch.randn(1, 9 * 12, 16)
    plan = ops.plan_for(x, attention="plain", attn_dropout=True)
    qkv = attn.qkv(ops.window_partition(x, layout, plan)).detach()
    table = attn.relative_position_bias_table
    runs = [window_attention(qkv, table, layout, plan, num_heads=2, scale=attn.scale, dropout_p=0.5) for _ in range(2)]
    assert not torch.equal(runs[0], runs[1])
    off = ops.plan_for(x, attention="plain", attn_dropout=False)  # (eval: the rate is not applied)
    runs = [window_attention(qkv, table, layout, off, num_heads=2, scale=attn.scale, dropout_p=0.5) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def _masked_window(layout):
    """The first window whose mask is not all zeros."""
    return int((layout.mask != 0).flatten(1).any(1).nonzero()[0])


def test_masked_keys_get_no_weight():
    # A key in another region contributes nothing: changing its value leaves its region's
    # outputs alone (shifted 14x14 map: the last window column mixes regions).
    torch.manual_seed(0)
    layout = _layout(14, 14, 3, dtype=torch.float32)
    heads, d = 1, 2
    qkv = torch.randn(1, layout.index.numel(), 3 * heads * d)
    table = torch.zeros(13 * 13, heads)
    x = torch.zeros(1, 14 * 14, heads * d)
    for kernel in KERNELS:
        plan = ops.plan_for(x, grad=False, attention=kernel)
        base = window_attention(qkv, table, layout, plan, num_heads=heads, scale=d**-0.5, dropout_p=0.0)
        win = _masked_window(layout)
        mask = layout.mask[win]
        query = int((mask[:, 0] == 0).nonzero()[0])  # a query in key 0's region
        other = int((mask[query] != 0).nonzero()[0])  # a key outside that region
        qkv2 = qkv.clone()
        qkv2[0, win * 49 + other, 2 * d :] += 10.0  # change that key's value
        out2 = window_attention(qkv2, table, layout, plan, num_heads=heads, scale=d**-0.5, dropout_p=0.0)
        token = int(layout.index[win * 49 + query])  # the query's row-major position
        torch.testing.assert_close(out2[0, token], base[0, token])
        assert not torch.allclose(out2, base)  # the changed value does reach its own region


def test_layout_bias_index_gathers_the_table():
    # The layout's bias_index reads the (nH, N, N) relative position bias out of a table of
    # its table_window, as the official index does; a smaller window reads a subset exactly.
    table = torch.randn(13 * 13, 3)
    cpu = torch.device("cpu")
    layout = build_window_layout(14, 14, 7, 3, True, cpu, torch.float32)
    bias = table.t().index_select(1, layout.bias_index).view(-1, 49, 49)
    assert bias.shape == (3, 49, 49) and bias.is_contiguous()
    ref = table[relative_position_index(7, 7, table.device)].view(49, 49, 3).permute(2, 0, 1)
    torch.testing.assert_close(bias, ref, rtol=0, atol=0)
    small = build_window_layout(3, 5, 3, 0, True, cpu, torch.float32, table_window=7)
    sub = table.t().index_select(1, small.bias_index).view(-1, 9, 9)
    torch.testing.assert_close(sub, table[relative_position_index(3, 7, cpu)].view(9, 9, 3).permute(2, 0, 1),
                               rtol=0, atol=0)
    assert torch.equal(build_window_layout(3, 5, 3, 0, True, cpu, torch.float32).bias_index,
                       relative_position_index(3, 3, cpu))  # table_window 0: the window's own table


def test_sdpa_ready_casts_and_aligns_rows():
    bias = torch.randn(3, 49, 49, requires_grad=True)
    assert sdpa_ready(bias, torch.float32, align=False) is bias
    assert sdpa_ready(bias, torch.bfloat16, align=False).dtype == torch.bfloat16
    ready = sdpa_ready(bias, torch.float32, align=True)
    assert ready.stride() == (49 * 56, 56, 1)
    torch.testing.assert_close(ready, bias)
    ready.sum().backward()  # differentiable: the bias gradient flows through the padding
    torch.testing.assert_close(bias.grad, torch.ones_like(bias))
    aligned = torch.zeros(2, 3, 8, 8)
    assert sdpa_ready(aligned, torch.float32, align=True) is aligned  # nothing to do


@pytest.mark.parametrize("size,shift", [((9, 12), 3), ((14, 14), 3), ((5, 5), 0)])
def test_per_window_bias_aligned_equals_plain_sum(size, shift):
    bias = torch.randn(2, 49, 49, requires_grad=True)
    for align in (False, True):
        layout = build_window_layout(*size, 7, shift, True, torch.device("cpu"), torch.float32, align)
        out = per_window_bias(layout.mask, bias, torch.float32, align)
        torch.testing.assert_close(out, layout.mask[:, None] + bias)
        if align:
            assert layout.mask.stride()[-2:] == (56, 1) and out.stride()[-2:] == (56, 1)
            assert all(st % 8 == 0 for st in out.stride()[:-1])


@pytest.mark.parametrize("size,shift,mask_padding", [((14, 21), 3, True), ((14, 21), 3, False), ((9, 12), 0, True),
                                                     ((9, 12), 3, True), ((14, 14), 0, True)])
@pytest.mark.parametrize("align", [False, True])
def test_layout_masks_are_the_window_attention_masks(size, shift, mask_padding, align):
    # The layout's mask is the official region mask (None where no window mixes regions), in
    # the compute dtype, with 8-aligned rows where asked.
    cpu = torch.device("cpu")
    layout = build_window_layout(*size, 7, shift, mask_padding, cpu, torch.bfloat16, align)
    expected = window_attention_mask(*size, 7, shift, mask_padding, cpu, torch.bfloat16, align)
    if expected is None:
        assert layout.mask is None
        return
    assert layout.mask.dtype == torch.bfloat16 and layout.mask.stride() == expected.stride()
    assert torch.equal(layout.mask, expected)


def test_masked_windows_are_the_last_row_and_column():
    # Without padding only the last row / column of windows mixes shift regions: the other
    # windows' masks are all zeros.
    layout = _layout(14, 21, 3)
    n_h, n_w = 2, 3
    expected = {i for i in range(n_h * n_w) if i % n_w == n_w - 1 or i // n_w == n_h - 1}
    assert set((layout.mask != 0).flatten(1).any(1).nonzero().squeeze(1).tolist()) == expected


@pytest.mark.parametrize("size,shift,mask_padding,window", [
    ((14, 14), 3, True, 7), ((9, 12), 3, True, 7), ((9, 12), 0, True, 7), ((9, 12), 3, False, 7), ((5, 3), 0, False, 7),
    ((5, 3), 3, True, 7), ((3, 5), 0, True, 3),  # a smaller effective window (pad_small_map=False) reads a subset
])
@pytest.mark.parametrize("kernel", ["plain", "sdpa", "recompute"])
@pytest.mark.parametrize("save_memory", [False, True], ids=["autograd", "lean-saves"])
def test_every_kernel_is_the_reference_algorithm(size, shift, mask_padding, window, kernel, save_memory):
    # The block's attention (norm -> qkv -> kernel -> projection), whichever kernel runs it,
    # with its input side (norm, gather, qkv) under lean saves (the norm's output and the gathered
    # windows rebuilt in backward) or not, computes what the plain reference function computes
    # (values and gradients).
    from swin_backbone.ops.attention import reference_window_attention

    torch.manual_seed(0)
    (h, w), table_window, heads = size, 7, 2
    attn = WindowAttention(16, heads, table_window).double()
    norm = torch.nn.LayerNorm(16).double()
    with torch.no_grad():
        attn.relative_position_bias_table.normal_(0, 1)
        norm.weight.normal_(1, 0.3)
    x = torch.randn(2, h * w, 16, dtype=torch.float64, requires_grad=True)
    plan = ops.plan_for(x, attention=kernel, grad=True, save_memory=save_memory)
    layout = build_window_layout(h, w, window, shift, mask_padding, x.device, x.dtype, table_window=table_window)
    with ops.lean_saves(plan):
        got = attn(x, norm, layout, plan)
    ref = reference_window_attention(norm(x), attn.qkv, attn.proj, attn.relative_position_bias_table, table_window, h,
                                     w, window, shift, heads, attn.scale, mask_padding)
    torch.testing.assert_close(got, ref)
    params = [x, attn.relative_position_bias_table, attn.qkv.weight, norm.weight]
    probe = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, params, probe), torch.autograd.grad(ref, params, probe)):
        torch.testing.assert_close(a, b)
