"""The fused (SDPA), plain and recompute attention kernels agree, in values and gradients."""
import dataclasses

import pytest
import torch

from swin_backbone.model.attention import WindowAttention
from swin_backbone.ops.attention import KERNELS, attention_to_tokens, choose_kernel, window_attention
from swin_backbone.ops.windows import build_window_layout


def _layout(h, w, shift, mask_padding=True):
    return build_window_layout(h, w, 7, shift, mask_padding, torch.device("cpu"), torch.float32)


@pytest.fixture(params=[None, 1, 3, "keep"], ids=["whole", "1-window-chunks", "3-window-chunks", "kept-probs"])
def windows_per_chunk(request, monkeypatch):
    """Returns a setter that makes the recompute backward run this many windows per chunk
    (given one window's logits bytes; None keeps the default budget), or ("keep") makes the
    forward keep the probabilities instead."""
    from swin_backbone import attention, chunked

    monkeypatch.setattr(attention, "KEEP_PROBS_BYTES", 2**40 if request.param == "keep" else 0)

    def set_budget(window_bytes):
        if isinstance(request.param, int):
            monkeypatch.setattr(chunked, "ATTENTION_CHUNK_BYTES", request.param * window_bytes)

    return set_budget


@pytest.mark.parametrize("size,shift", [((14, 14), 0), ((14, 14), 3), ((9, 12), 0), ((9, 12), 3), ((22, 15), 3)])
def test_kernels_agree_forward_and_backward(size, shift, windows_per_chunk):
    windows_per_chunk(2 * 4 * 49 * 49 * 8)  # batch x heads x N x N float64
    torch.manual_seed(0)
    attn = WindowAttention(32, 4, 7).double()
    torch.nn.init.normal_(attn.relative_position_bias_table, std=0.5)
    layout = _layout(*size, shift)
    x = torch.randn(2, layout.index.numel(), 32, dtype=torch.float64)
    grads = {}
    outs = {}
    for kernel in KERNELS:
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        mask = None if layout.mask is None else layout.mask.double()
        out = attn(xi, dataclasses.replace(layout, mask=mask), kernel=kernel)
        out.square().sum().backward()
        outs[kernel] = out.detach()
        grads[kernel] = (xi.grad, attn.relative_position_bias_table.grad.clone(), attn.qkv.weight.grad.clone())
    for kernel in ("fused", "recompute"):
        torch.testing.assert_close(outs[kernel], outs["plain"])
        for a, b in zip(grads[kernel], grads["plain"]):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("size,shift,mask_padding", [((4, 6), 0, False), ((3, 5), 1, True), ((4, 4), 1, False)])
def test_recompute_kernel_gradcheck(size, shift, mask_padding, windows_per_chunk):
    # The hand-written backward against finite differences, for qkv and the bias, with no
    # mask, with shift + padding masks, and with a shift mask alone.
    torch.manual_seed(0)
    heads, d, window = 2, 3, 2
    windows_per_chunk(2 * heads * window**4 * 8)
    layout = build_window_layout(*size, window, shift, mask_padding, torch.device("cpu"), torch.float64)
    assert (layout.mask is None) == (shift == 0 and not mask_padding)
    qkv = torch.randn(2, layout.index.numel(), 3 * heads * d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(heads, window**2, window**2, dtype=torch.float64, requires_grad=True)

    def fn(qkv, bias):
        return attention_to_tokens(qkv, heads, bias, layout, d**-0.5, kernel="recompute")

    assert torch.autograd.gradcheck(fn, (qkv, bias))


def test_kernel_choice():
    q = torch.zeros(1, 1, 4, 2)
    bias = torch.zeros(1, 1, 4, 4, requires_grad=True)
    assert choose_kernel(q, bias) == "recompute"  # CPU training: SDPA forward, own backward
    assert choose_kernel(q, bias, dropout_p=0.1) == "plain"  # dropout needs autograd's graph
    with torch.no_grad():
        assert choose_kernel(q, bias) == "fused"
    assert choose_kernel(q, bias.detach()) == "fused"
    layout = _layout(7, 7, 0)
    qkv, bias = torch.zeros(1, 49, 6), torch.zeros(1, 49, 49)
    with pytest.raises(ValueError, match="kernel must be one of"):
        attention_to_tokens(qkv, 1, bias, layout, 1.0, kernel="flash")
    with pytest.raises(ValueError, match="kernel must be 'fused', 'plain'"):
        window_attention(qkv, 1, 1, bias, None, 1.0, kernel="recompute")
    with pytest.raises(ValueError, match="dropout_p=0.5"):
        attention_to_tokens(qkv, 1, bias, layout, 1.0, 0.5, kernel="recompute")


def test_masked_keys_get_no_weight():
    # A key in another region contributes nothing: changing its value leaves the output alone.
    torch.manual_seed(0)
    n, heads, d = 4, 1, 2
    mask = torch.zeros(1, n, n)
    mask[0, :2, 2:] = -100
    mask[0, 2:, :2] = -100
    qkv = torch.randn(1, n, 3 * heads * d)
    bias = torch.zeros(heads, n, n)
    base = window_attention(qkv, heads, 1, bias, mask, d**-0.5)
    qkv2 = qkv.clone()
    qkv2[0, 3, 2 * d :] += 10.0  # change value of token 3 (region 1)
    out2 = window_attention(qkv2, heads, 1, bias, mask, d**-0.5)
    torch.testing.assert_close(out2[0, :2], base[0, :2])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("size,shift,batch", [((9, 12), 3, 2), ((9, 12), 0, 1), ((14, 21), 3, 1), ((8, 8), 3, 3)])
def test_masked_window_fixup_equals_full_mask(kernel, size, shift, batch, monkeypatch):
    # Recomputing only the windows whose mask is non-zero gives the full-mask result.
    from swin_backbone import attention

    monkeypatch.setattr(attention, "RECOMPUTE_MASKED_SHARE", 1.0)  # always, at these small sizes
    torch.manual_seed(0)
    attn = WindowAttention(16, 2, 7).double()
    torch.nn.init.normal_(attn.relative_position_bias_table, std=0.5)
    layout = build_window_layout(*size, 7, shift, True, torch.device("cpu"), torch.float64)
    assert layout.masked_windows is not None and 0 < layout.masked_windows.numel() < layout.num_windows + 1
    full = dataclasses.replace(layout, masked_windows=None, window_masks=None)
    x = torch.randn(batch, layout.index.numel(), 16, dtype=torch.float64)
    results = []
    for lay in (layout, full):
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = attn(xi, lay, kernel=kernel)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad, attn.relative_position_bias_table.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    if size[0] % 7 == 0 and size[1] % 7 == 0:  # no padding: only the last row / column of windows
        n_h, n_w = size[0] // 7, size[1] // 7
        expected = {i for i in range(n_h * n_w) if i % n_w == n_w - 1 or i // n_w == n_h - 1}
        assert set(layout.masked_windows.tolist()) == expected


@pytest.mark.parametrize("share", [0.0, 1.0], ids=["per-window-bias", "masked-recompute"])
@pytest.mark.parametrize("train", [False, True])
def test_cpu_uses_flash_sdpa_not_math(train, share, monkeypatch):
    # torch silently falls back to its slow math SDPA kernel for some masks (one that requires
    # grad, even under no_grad): the backbone must reach the CPU flash kernel in eval and in
    # training (inside the recompute kernel), with a per-window bias and with the masked-window
    # recompute.
    from torch.profiler import profile

    from swin_backbone import SwinBackbone, attention

    monkeypatch.setattr(attention, "RECOMPUTE_MASKED_SHARE", share)
    monkeypatch.setattr(attention, "KEEP_PROBS_BYTES", 0)  # the SDPA forward, at this small size

    from .conftest import small_arch

    model = SwinBackbone(**small_arch()).train(train)
    x = torch.randn(2, 3, 61, 75)
    with torch.set_grad_enabled(train), profile() as prof:
        outs = model(x)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names
    if train:
        sum(o.sum() for o in outs).backward()
