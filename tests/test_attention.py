"""The fused (SDPA) and plain attention kernels agree, in values and gradients."""
import dataclasses

import pytest
import torch

from swin_backbone.attention import WindowAttention, choose_fused, window_attention
from swin_backbone.windows import build_window_layout


def _layout(h, w, shift, mask_padding=True):
    return build_window_layout(h, w, 7, shift, mask_padding, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("size,shift", [((14, 14), 0), ((14, 14), 3), ((9, 12), 0), ((9, 12), 3)])
def test_fused_equals_plain_forward_and_backward(size, shift):
    torch.manual_seed(0)
    attn = WindowAttention(32, 4, 7).double()
    torch.nn.init.normal_(attn.relative_position_bias_table, std=0.5)
    layout = _layout(*size, shift)
    x = torch.randn(2, layout.index.numel(), 32, dtype=torch.float64)
    grads = {}
    outs = {}
    for fused in (True, False):
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        mask = None if layout.mask is None else layout.mask.double()
        out = attn(xi, dataclasses.replace(layout, mask=mask), fused=fused)
        out.square().sum().backward()
        outs[fused] = out.detach()
        grads[fused] = (xi.grad, attn.relative_position_bias_table.grad.clone(), attn.qkv.weight.grad.clone())
    torch.testing.assert_close(outs[True], outs[False])
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b)


def test_kernel_choice():
    q = torch.zeros(1, 1, 4, 2)
    bias = torch.zeros(1, 1, 4, 4, requires_grad=True)
    assert not choose_fused(q, bias)  # CPU, grad needed for the bias: plain is faster
    with torch.no_grad():
        assert choose_fused(q, bias)
    assert choose_fused(q, bias.detach())


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


def test_memory_saving_mlp_matches_autograd():
    from swin_backbone.blocks import Mlp

    torch.manual_seed(0)
    mlp = Mlp(8, 32).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out = mlp(x)  # grad enabled, no dropout: the recomputing path
    ref = mlp.fc2(mlp.act(mlp.fc1(x)))
    torch.testing.assert_close(out, ref)
    torch.autograd.gradcheck(lambda t: mlp(t), (x,))
    grads = torch.autograd.grad(out.square().sum(), [x, mlp.fc1.weight, mlp.fc2.weight, mlp.fc2.bias])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, mlp.fc1.weight, mlp.fc2.weight, mlp.fc2.bias])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("size,shift,batch", [((9, 12), 3, 2), ((9, 12), 0, 1), ((14, 21), 3, 1), ((8, 8), 3, 3)])
def test_masked_window_fixup_equals_full_mask(fused, size, shift, batch):
    # Recomputing only the windows whose mask is non-zero gives the full-mask result.
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
        out = attn(xi, lay, fused=fused)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad, attn.relative_position_bias_table.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    if size[0] % 7 == 0 and size[1] % 7 == 0:  # no padding: only the last row / column of windows
        n_h, n_w = size[0] // 7, size[1] // 7
        expected = {i for i in range(n_h * n_w) if i % n_w == n_w - 1 or i // n_w == n_h - 1}
        assert set(layout.masked_windows.tolist()) == expected
