"""The window-attention implementations (SDPA, plain, CPU recompute) agree, in values and
gradients, with every masked-window strategy and every backward mode."""
import pytest
import torch

from swin_backbone import ops
from swin_backbone.model.attention import WindowAttention
from swin_backbone.ops.attention import per_window_bias, relative_position_bias, run_kernel, sdpa_ready
from swin_backbone.ops.layouts import build_window_layout
from swin_backbone.ops.windows import relative_position_index

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


def _attend(attn, x, layout, kernel, fixup, chunk):
    """The attention module's computation with a plan forcing these choices (no norm)."""
    plan = ops.plan_for(
        x, grad=True, attention=kernel, save_memory=False, chunk_bytes=chunk, fixup_share=1.0 if fixup else 0.0
    )
    return attn(x, torch.nn.Identity(), layout, plan)


@pytest.mark.parametrize("size,shift", [((14, 14), 0), ((14, 14), 3), ((9, 12), 0), ((9, 12), 3), ((22, 15), 3)])
@pytest.mark.parametrize("fixup", [False, True], ids=["per-window-bias", "masked-fixup"])
@pytest.mark.parametrize("batch", [1, 2])  # SDPA puts per-window biases in its batch (1) or heads (2) dim
def test_kernels_agree_forward_and_backward(size, shift, fixup, batch, backward_mode):
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
        out = _attend(attn, xi, layout, kernel, fixup, chunk)
        out.square().sum().backward()
        outs[kernel] = out.detach()
        grads[kernel] = (xi.grad, attn.relative_position_bias_table.grad.clone(), attn.qkv.weight.grad.clone())
    # The reference: plain kernel, one per-window bias, autograd's graph.
    attn.zero_grad()
    xi = x.clone().requires_grad_(True)
    ref = _attend(attn, xi, layout, "plain", False, 0)
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

    def fn(qkv, bias):
        return run_kernel(qkv, bias, layout, heads, d**-0.5, 0.0, "recompute", False, chunk)

    assert torch.autograd.gradcheck(fn, (qkv, bias))


def test_bad_kernel_arguments_raise():
    layout = _layout(7, 7, 0)
    qkv, bias = torch.zeros(1, 49, 6), torch.zeros(1, 49, 49)
    with pytest.raises(ValueError, match="kernel: expected 'sdpa', 'plain' or 'recompute', got 'flash'"):
        run_kernel(qkv, bias, layout, 1, 1.0, kernel="flash")
    with pytest.raises(ValueError, match="dropout_p=0.5"):
        run_kernel(qkv, bias, layout, 1, 1.0, 0.5, kernel="recompute")
    with pytest.raises(ValueError, match="attention: expected one of"):
        ops.plan_for(qkv, attention="flash")


def test_masked_keys_get_no_weight():
    # A key in another region contributes nothing: changing its value leaves its region's
    # outputs alone (shifted 14x14 map: the last window column mixes regions).
    torch.manual_seed(0)
    layout = _layout(14, 14, 3, dtype=torch.float32)
    heads, d = 1, 2
    qkv = torch.randn(1, layout.index.numel(), 3 * heads * d)
    bias = torch.zeros(heads, 49, 49)
    base = run_kernel(qkv, bias, layout, heads, d**-0.5)
    win = int(layout.masked_windows[0])
    mask = layout.mask[win]
    query = int((mask[:, 0] == 0).nonzero()[0])  # a query in key 0's region
    other = int((mask[query] != 0).nonzero()[0])  # a key outside that region
    qkv2 = qkv.clone()
    qkv2[0, win * 49 + other, 2 * d :] += 10.0  # change that key's value
    out2 = run_kernel(qkv2, bias, layout, heads, d**-0.5)
    token = int(layout.index[win * 49 + query])  # the query's row-major position
    torch.testing.assert_close(out2[0, token], base[0, token])
    assert not torch.allclose(out2, base)  # the changed value does reach its own region


def test_relative_position_bias_gathers_the_table():
    table = torch.randn(13 * 13, 3)
    bias = relative_position_bias(table, 7, 7)
    assert bias.shape == (3, 49, 49) and bias.is_contiguous()
    ref = table[relative_position_index(7, 7, table.device)].view(49, 49, 3).permute(2, 0, 1)
    torch.testing.assert_close(bias, ref)
    sub = relative_position_bias(table, 3, 7)  # a smaller window reads a subset exactly
    torch.testing.assert_close(sub, table[relative_position_index(3, 7, table.device)].view(9, 9, 3).permute(2, 0, 1))


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


def test_masked_windows_are_the_last_row_and_column():
    # Without padding only the last row / column of windows mixes shift regions.
    layout = _layout(14, 21, 3)
    n_h, n_w = 2, 3
    expected = {i for i in range(n_h * n_w) if i % n_w == n_w - 1 or i // n_w == n_h - 1}
    assert set(layout.masked_windows.tolist()) == expected


@pytest.mark.parametrize("size,shift,mask_padding", [((14, 14), 3, True), ((9, 12), 3, True), ((9, 12), 0, True),
                                                     ((9, 12), 3, False), ((5, 3), 0, False), ((5, 3), 3, True)])
@pytest.mark.parametrize("kernel", ["plain", "sdpa", "recompute"])
def test_every_kernel_is_the_reference_algorithm(size, shift, mask_padding, kernel):
    # The block's attention (norm -> qkv -> kernel -> projection), whichever kernel runs it,
    # computes what the plain reference function computes (values and gradients).
    from swin_backbone import ops
    from swin_backbone.model.attention import WindowAttention
    from swin_backbone.ops.attention import reference_window_attention

    torch.manual_seed(0)
    (h, w), window, heads = size, 7, 2
    attn = WindowAttention(16, heads, window).double()
    norm = torch.nn.LayerNorm(16).double()
    with torch.no_grad():
        attn.relative_position_bias_table.normal_(0, 1)
    x = torch.randn(2, h * w, 16, dtype=torch.float64, requires_grad=True)
    plan = ops.plan_for(x, attention=kernel, grad=True)
    layout = build_window_layout(h, w, window, shift, mask_padding, x.device, x.dtype)
    got = attn(x, norm, layout, plan)
    ref = reference_window_attention(norm(x), attn.qkv, attn.proj, attn.relative_position_bias_table, window, h, w,
                                     window, shift, heads, attn.scale, mask_padding)
    torch.testing.assert_close(got, ref)
    params = [x, attn.relative_position_bias_table, attn.qkv.weight, norm.weight]
    probe = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, params, probe), torch.autograd.grad(ref, params, probe)):
        torch.testing.assert_close(a, b)
