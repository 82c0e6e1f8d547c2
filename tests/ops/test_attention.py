"""The window-attention implementations (SDPA, matmul, CPU recompute) agree, in values and
gradients, with the reference algorithm and with each other, in every backward mode."""
import dataclasses

import pytest
import torch

from swin_backbone import ops
from swin_backbone.model.blocks import WindowAttention
from swin_backbone.ops import planner
from swin_backbone.ops.attention import (
    KERNELS as ATTEND, _RecomputedAttention, attention_in_windows, sdpa_ready, window_attention,
)
from swin_backbone.ops.layouts import build_window_layout
from swin_backbone.ops.windows import relative_position_index, window_attention_mask

KERNELS = ("sdpa", "matmul", "recompute")


def _layout(h, w, shift, mask_padding=True, dtype=torch.float64, plan=None):
    """A 7-window layout of an ``h x w`` map, bound to ``plan`` (the ops read the plan from it)."""
    layout = build_window_layout(h, w, 7, shift, mask_padding, torch.device("cpu"), dtype)
    return layout if plan is None else dataclasses.replace(layout, plan=plan)


@pytest.fixture(params=[None, 1, 3], ids=["whole", "1-window-chunks", "3-window-chunks"])
def backward_mode(request):
    """``chunk_bytes`` for the recompute kernel, given one window's logits bytes: whole-tensor
    backward, or 1- and 3-window groups."""

    def settings(window_bytes):
        return 0 if request.param is None else 2 * request.param * window_bytes  # groups take chunk_bytes / 2

    return settings


def _attend(attn, x, layout, kernel, chunk):
    """The attention module's computation (no norm) with a plan forcing these choices, bound to
    the layout the module reads it from."""
    plan = ops.plan_for(x, grad=True, attention=kernel, save_memory=False, chunk_bytes=chunk)
    return attn(x, dataclasses.replace(layout, plan=plan))


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
    # The reference: matmul kernel (one per-window bias), autograd's graph.
    attn.zero_grad()
    xi = x.clone().requires_grad_(True)
    ref = _attend(attn, xi, layout, "matmul", 0)
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

    plan = ops.plan_for(qkv, grad=True, chunk_bytes=chunk)
    assert not layout.align  # (the kernel reads the alignment and the chunk size from the bound layout)
    bound = dataclasses.replace(layout, plan=plan)

    def fn(qkv, bias):  # (no dropout: the planner runs "matmul" for it)
        return _RecomputedAttention.apply(qkv, bias, bound, heads, d**-0.5)

    assert torch.autograd.gradcheck(fn, (qkv, bias))


def test_bad_kernel_arguments_raise():
    qkv = torch.zeros(1, 49, 6)
    with pytest.raises(ValueError, match="attention: expected one of"):
        ops.plan_for(qkv, attention="flash")
    with pytest.raises(ValueError, match="attention: expected one of .*got 'flash'"):
        ops.resolve_attention("flash")


@pytest.mark.parametrize("value", ["flash", "triton", "SDPA"])
def test_an_unknown_attention_value_is_a_clear_error(monkeypatch, value):
    # The backbone's argument and the environment variable that overrides it: the error names
    # which one was wrong, the accepted values and the value given.
    from swin_backbone import SwinBackbone

    tiny = dict(embed_dims=8, depths=(1,), num_heads=(1,), out_indices=(0,))
    expected = r" expected one of \('auto', 'sdpa'\), got '%s'$" % value
    with pytest.raises(ValueError, match=r"^attention:" + expected):
        SwinBackbone(**tiny, attention=value)
    monkeypatch.setenv(planner.ENV_VAR, value)
    with pytest.raises(ValueError, match=r"^SWIN_BACKBONE_ATTENTION:" + expected):
        SwinBackbone(**tiny)


def test_attention_dropout_always_runs_a_kernel_that_drops():
    # Only the matmul kernel applies attention dropout (SDPA's CPU kernels and the recompute
    # kernel's hand-written backward do not): every situation with attention dropout plans it,
    # on every device, eagerly and while tracing.
    for device in ("cpu", "cuda"):
        for grad, traced in ((True, False), (False, False), (True, True), (False, True)):
            plan = planner._decide(device, grad, traced, True, True, True, planner._SWITCHES)
            assert plan.attention == "matmul", (device, grad, traced, plan.attention)
    # ... and that kernel drops: two calls with a rate differ, and zero attention dropout is deterministic.
    attn = WindowAttention(16, 2, 7, attn_drop_rate=0.5)
    x = torch.randn(1, 9 * 12, 16)
    layout = _layout(9, 12, 3, dtype=torch.float32, plan=ops.plan_for(x, attention="matmul"))
    qkv = attn.qkv(ops.window_partition(x, layout)).detach()
    table = attn.relative_position_bias_table
    runs = [window_attention(qkv, table, layout, num_heads=2, scale=attn.scale, dropout_p=0.5) for _ in range(2)]
    assert not torch.equal(runs[0], runs[1])
    runs = [window_attention(qkv, table, layout, num_heads=2, scale=attn.scale, dropout_p=0.0) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    # The module passes its rate only in training (eval: the rate is not applied).
    with torch.no_grad():
        assert not torch.equal(attn.train()(x, layout), attn(x, layout))
        assert torch.equal(attn.eval()(x, layout), attn(x, layout))


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
        layout = dataclasses.replace(layout, plan=ops.plan_for(x, grad=False, attention=kernel))
        base = window_attention(qkv, table, layout, num_heads=heads, scale=d**-0.5, dropout_p=0.0)
        win = _masked_window(layout)
        mask = layout.mask[win]
        query = int((mask[:, 0] == 0).nonzero()[0])  # a query in key 0's region
        other = int((mask[query] != 0).nonzero()[0])  # a key outside that region
        qkv2 = qkv.clone()
        qkv2[0, win * 49 + other, 2 * d :] += 10.0  # change that key's value
        out2 = window_attention(qkv2, table, layout, num_heads=heads, scale=d**-0.5, dropout_p=0.0)
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


def _plain_sum_attention(qkv, bias, mask, num_windows, heads, scale):
    """Attention of every window written out: logits + the plain sum ``mask[:, None] + bias``
    (no alignment), back in the windows' token order."""
    b, tokens, three_c = qkv.shape
    n, d = tokens // num_windows, three_c // (3 * heads)
    q, k, v = qkv.view(b, num_windows, n, 3, heads, d).permute(3, 0, 1, 4, 2, 5).unbind(0)  # (B, nW, nH, N, d)
    logits = q @ k.transpose(-2, -1) * scale + (mask[:, None] + bias)
    return (logits.softmax(-1) @ v).transpose(2, 3).reshape(b, tokens, three_c // 3)


@pytest.mark.parametrize("size,shift", [((9, 12), 3), ((14, 14), 3), ((5, 5), 0)])
@pytest.mark.parametrize("batch", [1, 2])  # per-window biases in SDPA's batch (1) or heads (2) dim
@pytest.mark.parametrize("kernel", ["matmul", "sdpa"])
def test_per_window_bias_aligned_equals_plain_sum(size, shift, batch, kernel):
    # attention_in_windows adds the mask to the bias per window: with align (CUDA) into 8-aligned
    # rows (the layout's aligned mask read in place). Aligned or not, the same values and bias
    # gradient as the plain unaligned sum.
    torch.manual_seed(0)
    heads, d = 2, 4
    bias = torch.randn(heads, 49, 49, dtype=torch.float64, requires_grad=True)
    results = {}
    for align in (False, True):
        layout = build_window_layout(*size, 7, shift, True, torch.device("cpu"), torch.float64, align)
        assert layout.mask is not None and layout.align == align
        if align:
            assert layout.mask.stride()[-2:] == (56, 1)
        if not results:  # (the same inputs and output gradient for both)
            qkv = torch.randn(batch, layout.index.numel(), 3 * heads * d, dtype=torch.float64)
            probe = torch.randn(batch, layout.index.numel(), heads * d, dtype=torch.float64)
        seen = []

        def run(q, k, v, *, attn_mask, dropout_p, scale):
            seen.append(attn_mask)
            return ATTEND[kernel](q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)

        out = attention_in_windows(qkv, bias, layout.mask, layout.num_windows, heads, d**-0.5, 0.0, run, align)
        (attn_mask,) = seen  # the per-window biases themselves: the plain sum
        torch.testing.assert_close(attn_mask.reshape(-1, heads, 49, 49), layout.mask[:, None] + bias)
        if align:  # the per-window biases handed to the kernel have 8-aligned rows
            assert attn_mask.stride()[-2:] == (56, 1)
            assert all(st % 8 == 0 for st in attn_mask.stride()[:-1])
        ref = _plain_sum_attention(qkv, bias, layout.mask, layout.num_windows, heads, d**-0.5)
        (grad,) = torch.autograd.grad(out, bias, probe)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(grad, torch.autograd.grad(ref, bias, probe)[0])
        results[align] = (out, grad)
    torch.testing.assert_close(results[True], results[False])


def _same_shifted_window(y1, x1, y2, x2, window, shift):
    """Whether two tokens of the padded map share a window of the shifted partition (Liu et al.
    2021, Figure 2: the window grid moved by ``shift`` down and right, its windows at the map's
    edges cut short; rows / columns above / left of ``shift`` form windows of their own)."""
    return (y1 - shift) // window == (y2 - shift) // window and (x1 - shift) // window == (x2 - shift) // window


def _allowed_pairs(height, width, window, shift, mask_padding):
    """Brute force over token coordinates: ``(nW, N, N)`` bool, whether query ``i`` of a window of
    the cyclically shifted map may attend to its key ``j``. The map is padded bottom / right to
    whole windows and rolled by ``-shift``: position ``(r, c)`` shows the padded map's
    ``((r + shift) % Hp, (c + shift) % Wp)``; windows row-major, tokens row-major in a window. Two
    tokens attend iff they share a window of the shifted partition and, with ``mask_padding``,
    both are image tokens, or both are padding (whose outputs are cropped)."""
    hp, wp = -(-height // window) * window, -(-width // window) * window
    windows = []
    for top in range(0, hp, window):
        for left in range(0, wp, window):
            tokens = [((r + shift) % hp, (c + shift) % wp)
                      for r in range(top, top + window) for c in range(left, left + window)]
            rows = []
            for y1, x1 in tokens:
                row = []
                for y2, x2 in tokens:
                    together = _same_shifted_window(y1, x1, y2, x2, window, shift)
                    if mask_padding:
                        real1, real2 = y1 < height and x1 < width, y2 < height and x2 < width
                        together = (together and real1 and real2) or not (real1 or real2)
                    row.append(together)
                rows.append(row)
            windows.append(rows)
    return torch.tensor(windows)


MASK_CASES = [  # (H, W), window, shift, mask_padding
    ((14, 21), 7, 3, True), ((14, 21), 7, 3, False), ((14, 14), 7, 0, True), ((9, 12), 7, 0, True),
    ((9, 12), 7, 0, False), ((9, 12), 7, 3, True), ((9, 12), 7, 3, False), ((22, 15), 7, 3, True), ((5, 3), 7, 3, True),
    ((3, 5), 3, 1, True), ((8, 10), 4, 2, True), ((8, 10), 4, 2, False),
]


@pytest.mark.parametrize("size,window,shift,mask_padding", MASK_CASES)
@pytest.mark.parametrize("dtype,align", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_masks_allow_exactly_the_pairs_of_one_shifted_window(size, window, shift, mask_padding, dtype, align):
    # The layout's mask and window_attention_mask against token coordinates worked out here:
    # (nW, N, N), 0 exactly where two tokens may attend to each other; elsewhere a finite value
    # whose softmax weight is exactly 0; None where no window mixes regions; 8-aligned rows
    # where asked.
    cpu = torch.device("cpu")
    allowed = _allowed_pairs(*size, window, shift, mask_padding)
    n = window * window
    assert allowed.shape == (-(-size[0] // window) * -(-size[1] // window), n, n)
    layout = build_window_layout(*size, window, shift, mask_padding, cpu, dtype, align)
    for mask in (layout.mask, window_attention_mask(*size, window, shift, mask_padding, cpu, dtype, align)):
        if bool(allowed.all()):
            assert mask is None
            continue
        assert mask.shape == allowed.shape and mask.dtype == dtype
        assert torch.equal(mask == 0, allowed)
        masked = mask[~allowed].float()
        assert torch.isfinite(masked).all() and torch.exp(masked).eq(0).all()
        if align:
            assert mask.stride(-1) == 1 and mask.stride(-2) % 8 == 0 and mask.stride(0) % 8 == 0


def _attention_token_by_token(x, qkv, proj, table, table_window, height, width, window, shift, heads, scale,
                              mask_padding):
    """Shifted-window attention of each image token, computed on its own: its keys are the tokens
    of its window of the shifted partition (:func:`_same_shifted_window`) in the padded map
    (padding: zero inputs), only the image's with ``mask_padding``; the bias is the table's row
    of their offset."""
    b, _, c = x.shape
    hp, wp = -(-height // window) * window, -(-width // window) * window
    grid = x.new_zeros(b, hp, wp, c)
    grid[:, :height, :width] = x.view(b, height, width, c)
    q, k, v = qkv(grid).view(b, hp, wp, 3, heads, c // heads).unbind(3)  # (B, Hp, Wp, nH, d) each
    side = 2 * table_window - 1
    out = []
    for y in range(height):
        for x_ in range(width):
            keys = [(y2, x2) for y2 in range(hp) for x2 in range(wp)
                    if _same_shifted_window(y, x_, y2, x2, window, shift)
                    and (not mask_padding or (y2 < height and x2 < width))]
            ys, xs = torch.tensor(keys).unbind(1)
            bias = table[(y - ys + table_window - 1) * side + (x_ - xs + table_window - 1)].t()  # (nH, K)
            logits = torch.einsum("bhd,bkhd->bhk", q[:, y, x_], k[:, ys, xs]) * scale + bias
            out.append(torch.einsum("bhk,bkhd->bhd", logits.softmax(-1), v[:, ys, xs]).reshape(b, c))
    return proj(torch.stack(out, 1))


@pytest.mark.parametrize("size,window,shift,mask_padding", [
    ((9, 12), 7, 3, True), ((9, 12), 7, 3, False), ((9, 12), 7, 0, True), ((14, 14), 7, 3, True), ((5, 3), 7, 3, True),
    ((8, 10), 4, 2, False),
])
def test_reference_attention_is_each_token_attending_its_shifted_window(size, window, shift, mask_padding):
    # The reference algorithm (pad, roll, windows, mask, unroll) that every kernel is checked
    # against computes, for each token, attention over its window of the shifted partition.
    from swin_backbone.ops.attention import reference_window_attention

    torch.manual_seed(0)
    (h, w), heads, table_window = size, 2, 7
    attn = WindowAttention(16, heads, table_window).double()
    torch.nn.init.normal_(attn.relative_position_bias_table, std=1.0)
    x = torch.randn(2, h * w, 16, dtype=torch.float64)
    args = (attn.qkv, attn.proj, attn.relative_position_bias_table, table_window, h, w, window, shift, heads,
            attn.scale, mask_padding)
    torch.testing.assert_close(reference_window_attention(x, *args), _attention_token_by_token(x, *args))


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
@pytest.mark.parametrize("kernel", ["matmul", "sdpa", "recompute"])
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
    with ops.LEAN_SAVES[plan.save_memory]:
        got = attn(norm(x), dataclasses.replace(layout, plan=plan))
    ref = reference_window_attention(norm(x), attn.qkv, attn.proj, attn.relative_position_bias_table, table_window, h,
                                     w, window, shift, heads, attn.scale, mask_padding)
    torch.testing.assert_close(got, ref)
    params = [x, attn.relative_position_bias_table, attn.qkv.weight, norm.weight]
    probe = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, params, probe), torch.autograd.grad(ref, params, probe)):
        torch.testing.assert_close(a, b)
