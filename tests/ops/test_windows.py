"""Window arithmetic against plain reference implementations (pad, roll, view/permute)."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from swin_backbone.ops import windows as W


def reference_partition(x, h, w, ws, shift):
    """mmdet's way: (B, H*W, C) -> pad -> roll -> partition -> (B, nW*N, C)."""
    b, _, c = x.shape
    x = x.view(b, h, w, c)
    x = F.pad(x, (0, 0, 0, W.pad_amount(w, ws), 0, W.pad_amount(h, ws)))
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    hp, wp = x.shape[1], x.shape[2]
    x = x.view(b, hp // ws, ws, wp // ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, -1, c)


def reference_mask(hp, wp, ws, shift):
    """mmdet's Python-loop shift mask."""
    img_mask = torch.zeros((1, hp, wp, 1))
    slices = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
    cnt = 0
    for hs in slices:
        for wsl in slices:
            img_mask[:, hs, wsl, :] = cnt
            cnt += 1
    win = img_mask.view(1, hp // ws, ws, wp // ws, ws, 1).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws)
    diff = win.unsqueeze(1) - win.unsqueeze(2)
    return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)


SIZES = [(1, 1), (7, 7), (8, 9), (13, 20), (14, 14), (3, 17), (25, 38)]


@pytest.mark.parametrize("size,ws,shift", [(s, ws, sh) for s in SIZES for ws, sh in [(7, 0), (7, 3), (4, 2), (3, 1)]])
def test_partition_matches_pad_roll_permute(size, ws, shift):
    h, w = size
    x = torch.randn(2, h * w, 5)
    layout = W.build_window_layout(h, w, ws, shift, True, torch.device("cpu"), torch.float32)
    got = W.window_partition(x, layout)
    torch.testing.assert_close(got, reference_partition(x, h, w, ws, shift), rtol=0, atol=0)
    # reverse undoes everything exactly
    torch.testing.assert_close(W.window_reverse(got, layout), x, rtol=0, atol=0)
    assert layout.num_windows == (W.padded_size(h, ws) // ws) * (W.padded_size(w, ws) // ws)
    assert layout.has_padding == (h % ws != 0 or w % ws != 0)


@pytest.mark.parametrize("size,shift", [((8, 9), 3), ((14, 14), 3), ((1, 1), 0), ((13, 20), 3)])
def test_gather_gradients_match_autograd_reference(size, shift):
    h, w = size
    ws = 7
    layout = W.build_window_layout(h, w, ws, shift, False, torch.device("cpu"), torch.float32)
    x1 = torch.randn(2, h * w, 4, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    probe = torch.randn(2, layout.index.numel(), 4, dtype=torch.float64)
    (W.window_partition(x1, layout) * probe).sum().backward()
    (reference_partition(x2, h, w, ws, shift) * probe).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    # and through reverse
    y = torch.randn(2, layout.index.numel(), 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: W.window_reverse(t, layout), (y,))
    torch.autograd.gradcheck(lambda t: W.window_partition(t, layout), (x1.detach().requires_grad_(True),))


@pytest.mark.parametrize("size", [(7, 7), (8, 9), (14, 21), (1, 1), (25, 38)])
def test_shift_mask_matches_mmdet_loop(size):
    ws, shift = 7, 3
    hp, wp = W.padded_size(size[0], ws), W.padded_size(size[1], ws)
    mask = W.window_attention_mask(*size, ws, shift, False, torch.device("cpu"), torch.float32)
    reference = reference_mask(hp, wp, ws, shift)  # mmdet's: -100 across regions
    assert torch.equal(mask != 0, reference != 0)
    assert (mask[mask != 0] == W.MASK_VALUE).all()


def test_padding_tokens_form_their_own_region():
    h, w, ws = 8, 9, 7
    for shift in (0, 3):
        labels = W.region_labels(h, w, ws, shift, True, torch.device("cpu"))
        # undo the shift: labels in the unshifted padded frame
        unrolled = torch.roll(labels, shifts=(shift, shift), dims=(0, 1))
        assert (unrolled[h:, :] == W.PAD_REGION).all() and (unrolled[:, w:] == W.PAD_REGION).all()
        assert (unrolled[:h, :w] != W.PAD_REGION).all()
    # no shift, no padding: no mask at all; no shift with padding: a mask only if masked
    assert W.window_attention_mask(14, 14, 7, 0, True, torch.device("cpu"), torch.float32) is None
    assert W.window_attention_mask(8, 9, 7, 0, False, torch.device("cpu"), torch.float32) is None
    mask = W.window_attention_mask(8, 9, 7, 0, True, torch.device("cpu"), torch.float32)
    assert mask is not None and mask.shape == (4, 49, 49)
    # every row keeps at least its own token (softmax never sees an all-masked row)
    assert (mask.diagonal(dim1=1, dim2=2) == 0).all()


def test_mask_value_is_finite_in_half_precision():
    for dtype in (torch.float16, torch.bfloat16):
        mask = W.window_attention_mask(9, 9, 7, 3, True, torch.device("cpu"), dtype)
        assert mask.dtype == dtype and torch.isfinite(mask).all() and mask.min() < -9000
        # masked weights underflow to exactly 0 (no denormals), even in half precision
        logits = torch.tensor([0.0, W.MASK_VALUE], dtype=dtype) + torch.tensor([0.0, 50.0], dtype=dtype)
        assert logits.float().softmax(0)[1] == 0


def test_relative_position_index_matches_mmdet_and_subwindows():
    ws = 7

    def double_step_seq(step1, len1, step2, len2):
        seq1 = torch.arange(0, step1 * len1, step1)
        seq2 = torch.arange(0, step2 * len2, step2)
        return (seq1[:, None] + seq2[None, :]).reshape(1, -1)

    coords = double_step_seq(2 * ws - 1, ws, 1, ws)
    mmdet_index = (coords + coords.T).flip(1).reshape(-1)
    torch.testing.assert_close(W.relative_position_index(ws, ws, torch.device("cpu")), mmdet_index)
    # a 4x4 window reads the centre of the 7x7 table: offset (0, 0) -> the table's centre row
    small = W.relative_position_index(4, ws, torch.device("cpu")).view(16, 16)
    centre = (ws - 1) * (2 * ws - 1) + (ws - 1)
    assert (small.diagonal() == centre).all()
    assert small.max() < (2 * ws - 1) ** 2


def test_effective_window():
    assert W.effective_window(5, 9, 7, 3, pad_small_map=True) == (7, 3)
    assert W.effective_window(5, 9, 7, 3, pad_small_map=False) == (5, 0)
    assert W.effective_window(7, 7, 7, 3, pad_small_map=False) == (7, 0)
    assert W.effective_window(8, 9, 7, 3, pad_small_map=False) == (7, 3)


def test_layout_cache_hits_and_keys():
    W.clear_caches()
    args = (10, 11, 7, 3, True, torch.device("cpu"))
    a = W.get_window_layout(*args, torch.float32)
    b = W.get_window_layout(*args, torch.float32)
    c = W.get_window_layout(*args, torch.bfloat16)
    assert a is b and c is not a and c.mask.dtype == torch.bfloat16
    info = W.get_window_layout.cache_info()
    assert info.hits == 1 and info.misses == 2


def test_output_size():
    assert W.output_size(1, 1, 4, 4) == ((1, 1),) * 4
    assert W.output_size(31, 33, 4, 4) == ((8, 9), (4, 5), (2, 3), (1, 2))
    for h, w in itertools.product([1, 5, 63, 64, 65], [3, 800]):
        sizes = W.output_size(h, w, 4, 4)
        assert sizes[0] == (-(-h // 4), -(-w // 4))


# ---------------------------------------------------------------- per-image edges
@pytest.mark.parametrize("size", [(9, 11), (8, 8), (5, 12), (1, 1)])
def test_merge_reads_what_each_image_reads_alone(size):
    """merge_2x2 with valid sizes == zeroing everything beyond each image, then the
    official 2x2 gather, over every cell that holds a token of the image."""
    h, w = size
    valid = tuple((vh, vw) for vh in {1, max(h - 1, 1), h} for vw in {1, max(w - 2, 1), w})
    x = torch.randn(len(valid), h, w, 3) + 5  # non-zero everywhere beyond the images
    got = W.merge_2x2(x.clone(), valid)
    ref = W.zero_beyond_valid(x.clone(), valid, 1, inplace=True)
    ref = F.pad(ref, (0, 0, 0, w % 2, 0, h % 2))
    ref = torch.cat([ref[:, 0::2, 0::2], ref[:, 1::2, 0::2], ref[:, 0::2, 1::2], ref[:, 1::2, 1::2]], -1)
    for b, (vh, vw) in enumerate(valid):
        ch, cw = W.ceil_div(vh, 2), W.ceil_div(vw, 2)
        torch.testing.assert_close(got[b, :ch, :cw], ref[b, :ch, :cw], rtol=0, atol=0)
    full = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))  # without valid sizes: the plain official gather
    full = torch.cat([full[:, 0::2, 0::2], full[:, 1::2, 0::2], full[:, 0::2, 1::2], full[:, 1::2, 1::2]], -1)
    torch.testing.assert_close(W.merge_2x2(x), full, rtol=0, atol=0)


def test_straddle_boxes_and_input_masking():
    from swin_backbone import ops

    assert W.straddles(((8, 12), (4, 4)), 8, 12, 4) == ()  # multiples of the cell: nothing to zero
    assert W.straddles(((6, 12),), 8, 12, 4) == ((0, 6, 8, 0, 12),)
    assert W.straddles(((8, 9),), 8, 11, 4) == ((0, 0, 8, 9, 11),)  # capped at the map
    x = torch.randn(2, 3, 8, 12) + 3
    plan = ops.plan_for(x, valid_sizes=((8, 12), (4, 4)))
    assert ops.mask_input(x, plan, 4) is x  # no patch straddles an edge: no copy
    plan = ops.plan_for(x, valid_sizes=((6, 10), (8, 12)))
    before = x.clone()
    out = ops.mask_input(x, plan, 4)
    torch.testing.assert_close(x, before, rtol=0, atol=0)  # the caller's tensor is never written
    assert out[0, :, 6:8, :12].abs().max() == 0 and out[0, :, :6, 10:12].abs().max() == 0
    torch.testing.assert_close(out[0, :, :6, :10], x[0, :, :6, :10])
    torch.testing.assert_close(out[1], x[1])
    x[0, :, 6:8] = 0
    x[0, :, :, 10:] = 0
    assert ops.mask_input(x, plan, 4) is x  # zero-padded already (mmdet's batches): no copy
