"""Window arithmetic against plain reference implementations (pad, roll, view/permute)."""
import dataclasses
import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from swin_backbone.model.blocks import merge_2x2
from swin_backbone.ops import image_sizes as V, layouts as L, windows as W
from swin_backbone.ops.attention import _TokenGather, gather_tokens, window_partition
from swin_backbone.ops.planner import plan_for

from ..helpers import DeviceSyncs


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
    layout = L.build_window_layout(h, w, ws, shift, True, torch.device("cpu"), torch.float32)
    layout = dataclasses.replace(layout, plan=plan_for(x))
    got = window_partition(x, layout)
    torch.testing.assert_close(got, reference_partition(x, h, w, ws, shift), rtol=0, atol=0)
    # the layout's inverse gather (window_attention's window reverse) undoes everything exactly
    torch.testing.assert_close(gather_tokens(got, layout.inverse, False, None), x, rtol=0, atol=0)
    assert layout.num_windows == (W.padded_size(h, ws) // ws) * (W.padded_size(w, ws) // ws)
    assert layout.has_padding == (h % ws != 0 or w % ws != 0)


@pytest.mark.parametrize("size,shift", [((8, 9), 3), ((14, 14), 3), ((1, 1), 0), ((13, 20), 3)])
def test_gather_gradients_match_autograd_reference(size, shift):
    h, w = size
    ws = 7
    layout = L.build_window_layout(h, w, ws, shift, False, torch.device("cpu"), torch.float32)
    x1 = torch.randn(2, h * w, 4, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    probe = torch.randn(2, layout.index.numel(), 4, dtype=torch.float64)
    plan = plan_for(x1)
    assert plan.grad
    layout = dataclasses.replace(layout, plan=plan)
    (window_partition(x1, layout) * probe).sum().backward()
    (reference_partition(x2, h, w, ws, shift) * probe).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    # and through the window reverse (training's gather back: its backward gathers with the index)
    y = torch.randn(2, layout.index.numel(), 4, dtype=torch.float64, requires_grad=True)
    reverse = (layout.inverse, layout.index, layout.pad_slots, False, layout.has_padding)
    torch.autograd.gradcheck(lambda t: _TokenGather.apply(t, *reverse), (y,))
    torch.autograd.gradcheck(lambda t: window_partition(t, layout), (x1.detach().requires_grad_(True),))


def test_a_layout_without_a_plan_is_a_clear_error():
    # The ops read the forward's plan from the layout: one never bound to a plan is an error
    # naming the argument, not an AttributeError deep inside.
    layout = L.build_window_layout(8, 9, 7, 3, True, torch.device("cpu"), torch.float32)
    assert layout.plan is None
    x = torch.randn(1, 8 * 9, 4)
    with pytest.raises(ValueError, match="^layout: "):
        window_partition(x, layout)
    assert window_partition(x, dataclasses.replace(layout, plan=plan_for(x))).shape == (1, layout.index.numel(), 4)


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


def test_small_maps_without_pad_small_map_shrink_the_window_and_drop_the_shift():
    from swin_backbone import ops

    plan = ops.plan_for(torch.zeros(1), grad=False)
    for (h, w, pad_small_map), (window, shift) in {(5, 9, True): (7, 3), (5, 9, False): (5, 0),
                                                    (7, 7, False): (7, 0), (8, 9, False): (7, 3)}.items():
        regular, shifted = ops.stage_layouts(torch.empty(1, h, w, 1), plan, window_size=7, shift_size=3,
                                             pad_small_map=pad_small_map, mask_padding=True)
        assert (regular.window, regular.table_window) == (window, 7), (h, w, pad_small_map)
        assert (shifted.shift if shifted is not None else 0) == shift, (h, w, pad_small_map)


def test_layout_cache_hits_and_keys():
    L.clear_caches()
    args = (10, 11, 7, 3, True, torch.device("cpu"))
    a = L.get_window_layout(*args, torch.float32)
    b = L.get_window_layout(*args, torch.float32)
    c = L.get_window_layout(*args, torch.bfloat16)
    assert a is b and c is not a and c.mask.dtype == torch.bfloat16
    info = L.get_window_layout.cache_info()
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
    """A stage returns zeros beyond each image (per-image valid sizes): merge_2x2 of that map
    equals, over every cell that holds a token of an image, merge_2x2 of the image alone;
    and merge_2x2 is the official 2x2 gather."""
    h, w = size
    valid = tuple((vh, vw) for vh in {1, max(h - 1, 1), h} for vw in {1, max(w - 2, 1), w})
    x = torch.randn(len(valid), h, w, 3) + 5  # non-zero everywhere beyond the images
    got = merge_2x2(L.zero_beyond_valid(x.clone(), valid, 1, inplace=True))
    for b, (vh, vw) in enumerate(valid):
        ch, cw = W.ceil_div(vh, 2), W.ceil_div(vw, 2)
        torch.testing.assert_close(got[b, :ch, :cw], merge_2x2(x[b : b + 1, :vh, :vw])[0], rtol=0, atol=0)
    full = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))  # the plain official gather
    full = torch.cat([full[:, 0::2, 0::2], full[:, 1::2, 0::2], full[:, 0::2, 1::2], full[:, 1::2, 1::2]], -1)
    torch.testing.assert_close(merge_2x2(x), full, rtol=0, atol=0)


def test_straddle_boxes_and_input_masking():
    from swin_backbone import ops

    assert V.straddles(((8, 12), (4, 4)), 8, 12, 4) == ()  # multiples of the cell: nothing to zero
    assert V.straddles(((6, 12),), 8, 12, 4) == ((0, 6, 8, 0, 12),)
    assert V.straddles(((8, 9),), 8, 11, 4) == ((0, 0, 8, 9, 11),)  # capped at the map
    x = torch.randn(2, 3, 8, 12) + 3
    assert ops.mask_input(x, ((8, 12), (4, 4)), 4) is x  # no patch straddles an edge: no copy
    sizes = ((6, 10), (8, 12))
    before = x.clone()
    out = ops.mask_input(x, sizes, 4)
    torch.testing.assert_close(x, before, rtol=0, atol=0)  # the caller's tensor is never written
    assert out[0, :, 6:8, :12].abs().max() == 0 and out[0, :, :6, 10:12].abs().max() == 0
    torch.testing.assert_close(out[0, :, :6, :10], x[0, :, :6, :10])
    torch.testing.assert_close(out[1], x[1])
    x[0, :, 6:8] = 0
    x[0, :, :, 10:] = 0
    assert ops.mask_input(x, sizes, 4) is x  # zero-padded already (mmdet's batches): no copy


# ---------------------------------------------------------------- no host-device syncs, eager layouts
@functools.lru_cache(maxsize=None)
def _brute_force_layout(h, w, ws, shift, mask_padding, table_window):
    """A layout written out position by position from the definitions (the map padded bottom /
    right to multiples of ``ws``, then rolled by ``-shift``, then cut into row-major windows of
    row-major tokens; the official shift regions; padding a region of its own with
    ``mask_padding``), sharing no code with :mod:`swin_backbone.ops.windows`. Python lists."""
    hp, wp = -(-h // ws) * ws, -(-w // ws) * ws
    index, labels = [], []
    for wy, wx in itertools.product(range(hp // ws), range(wp // ws)):
        window_labels = []
        for i, j in itertools.product(range(ws), range(ws)):
            r, c = wy * ws + i, wx * ws + j  # on the shifted map
            y, x = (r + shift) % hp, (c + shift) % wp  # on the padded map
            index.append(y * w + x if y < h and x < w else h * w)
            region = 0 if shift == 0 else (r >= hp - ws) + (r >= hp - shift), \
                0 if shift == 0 else (c >= wp - ws) + (c >= wp - shift)
            padding = mask_padding and (y >= h or x >= w)
            window_labels.append("padding" if padding else region)
        labels.append(window_labels)
    inverse = [index.index(t) for t in range(h * w)]
    masked = shift > 0 or (mask_padding and (h % ws or w % ws))
    mask = [[[a != b for b in window] for a in window] for window in labels] if masked else None
    n = ws * ws
    bias = [((ai // ws - bi // ws) + table_window - 1) * (2 * table_window - 1) + (ai % ws - bi % ws) + table_window - 1
            for ai in range(n) for bi in range(n)]
    return index, inverse, mask, bias


def reference_layout(h, w, ws, shift, mask_padding, dtype, align, table_window):
    """What every layout tensor must equal, strides included: :func:`_brute_force_layout` as
    tensors (padding slots read token 0, listed in ``pad_slots``; a mask is 0 within a region,
    ``MASK_VALUE`` across, its rows 8-aligned with ``align``)."""
    index, inverse, mask, bias = _brute_force_layout(h, w, ws, shift, mask_padding, table_window)
    index = torch.tensor(index)
    out = dict(inverse=torch.tensor(inverse), pad_slots=None, bias_index=torch.tensor(bias), mask=None)
    if mask is not None:
        n = ws * ws
        rows = torch.zeros(len(mask), n, n + (-n) % 8 if align else n, dtype=dtype)
        out["mask"] = rows.narrow(-1, 0, n).masked_fill_(torch.tensor(mask), W.MASK_VALUE)
    if (index == h * w).any():
        is_pad = index == h * w
        out["pad_slots"] = is_pad.nonzero().squeeze(1)
        index = index.masked_fill(is_pad, 0)
    out["index"] = index
    return out


LAYOUT_NAMES = ("index", "inverse", "pad_slots", "mask", "bias_index")


def _assert_same_tensor(got, expected, what):
    if expected is None:
        assert got is None, what
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    assert got.stride() == expected.stride(), what  # 8-aligned rows stay aligned
    assert torch.equal(got, expected), what


@pytest.mark.parametrize("dtype,align", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True),
                                         (torch.float16, False)])
def test_layout_tensors_equal_the_reference_build(dtype, align):
    for (h, w), (ws, shift), mask_padding in itertools.product(
        SIZES + [(16, 16)], [(7, 0), (7, 3), (4, 2), (3, 1), (8, 4)], (True, False)
    ):
        table_window = ws + (h % 2)  # the bias table's window: the layout's, or (pad_small_map=False) larger
        layout = L.build_window_layout(h, w, ws, shift, mask_padding, torch.device("cpu"), dtype, align,
                                       table_window=table_window)
        expected = reference_layout(h, w, ws, shift, mask_padding, dtype, align, table_window)
        for name in LAYOUT_NAMES:
            _assert_same_tensor(getattr(layout, name), expected[name], (h, w, ws, shift, mask_padding, name))
        assert layout.num_windows * ws * ws == layout.index.numel()
        assert (layout.height, layout.width, layout.window, layout.shift) == (h, w, ws, shift)
        assert layout.table_window == table_window and layout.rows is None and not layout.traceable


def test_stage_layouts_are_cached_and_packed_from_the_images_layouts():
    # A stage's layouts come from the cache (built once per size, window, shift, device,
    # dtype, ...); with per-image valid sizes they are the cached packed layouts, built from the
    # images' own cached layouts.
    from swin_backbone import ops

    cpu = torch.device("cpu")
    L.clear_caches()
    x = torch.zeros(2, 13, 20, 16)
    plan = ops.plan_for(x, grad=False)
    stage = dict(window_size=7, shift_size=3, pad_small_map=True, mask_padding=True)

    def is_cached(layout, cached):
        """``layout`` is ``cached`` bound to the stage's plan: the cached tensors themselves."""
        return layout.plan is plan and all(
            getattr(layout, name) is getattr(cached, name) for name in ("index", "inverse", "mask", "bias_index", "rows"))

    regular, shifted = ops.stage_layouts(x, plan, **stage)
    assert L.get_window_layout.cache_info().misses == 2
    assert regular.shift == 0 and shifted.shift == 3 and regular.rows is None
    assert is_cached(shifted, L.get_window_layout(13, 20, 7, 3, True, cpu, torch.float32, False, False, 7))
    assert is_cached(regular, L.get_window_layout(13, 20, 7, 0, True, cpu, torch.float32, False, False, 7))
    assert shifted.mask.shape[0] == shifted.num_windows
    again = ops.stage_layouts(x, plan, **stage)  # the next forward at this size: no layout built
    assert L.get_window_layout.cache_info().misses == 2 and all(map(is_cached, again, (regular, shifted)))
    sizes = ((13, 20), (9, 11))
    regular2, shifted2 = ops.stage_layouts(x, plan, **stage, images=sizes)
    assert is_cached(shifted2, V.get_packed_layout(13, 20, 7, 3, sizes, cpu, torch.float32, False, 7, False))
    assert is_cached(regular2, V.get_packed_layout(13, 20, 7, 0, sizes, cpu, torch.float32, False, 7, False))
    assert regular2.rows is not None and regular2.image_tokens == (13 * 20, 9 * 11)
    assert L.get_window_layout.cache_info().misses == 4  # image 0 (= the map) hit; image 1's two built
    assert V.get_packed_layout.cache_info().misses == 2
    # a window no larger than the map with no shift: no shifted layout at all
    assert ops.stage_layouts(x, plan, **dict(stage, shift_size=0))[1] is None


def test_layouts_built_in_inference_mode_serve_training():
    L.clear_caches()
    with torch.inference_mode():
        layout = L.get_window_layout(9, 10, 4, 2, True, torch.device("cpu"), torch.float32)
    assert not layout.index.is_inference() and not layout.mask.is_inference()
    assert not layout.inverse.is_inference() and not layout.bias_index.is_inference()
    x = torch.randn(1, 90, 3, requires_grad=True)
    plan = plan_for(x)
    assert plan.grad
    window_partition(x, dataclasses.replace(layout, plan=plan)).sum().backward()  # saves index for backward: no error
    assert x.grad is not None


META = torch.device("meta")  # nonzero / item on a meta tensor raise: a device value read fails


@pytest.mark.parametrize("align", [False, True])
def test_layout_builders_never_wait_for_the_device(align):
    cpu = torch.device("cpu")
    for (h, w), (ws, shift), mask_padding in [((13, 20), (7, 3), True), ((14, 14), (7, 0), True),
                                              ((25, 38), (4, 2), False), ((8, 9), (7, 0), False)]:
        with DeviceSyncs() as syncs:
            layout = L.build_window_layout(h, w, ws, shift, mask_padding, META, torch.float16, align)
            got = {name: getattr(layout, name) for name in LAYOUT_NAMES}
        # One copy per tensor built on the CPU.
        syncs.assert_none(sum(got[name] is not None for name in LAYOUT_NAMES))
        expected = L.build_window_layout(h, w, ws, shift, mask_padding, cpu, torch.float16, align)
        for name, t in got.items():
            e = getattr(expected, name)
            assert (t is None) == (e is None), name
            if t is not None:  # same shapes and strides (aligned rows stay aligned on the device)
                assert t.device == META and t.dtype == e.dtype and t.shape == e.shape and t.stride() == e.stride(), name


PACKED_NAMES = LAYOUT_NAMES + ("rows",)


@pytest.mark.parametrize("align", [False, True])
def test_packed_layout_builder_never_waits_for_the_device(align):
    cpu = torch.device("cpu")
    h, w, ws, shift = 17, 23, 4, 2
    valid = ((17, 23), (9, 23), (5, 7), (17, 10))
    L.clear_caches()
    with DeviceSyncs() as syncs:
        packed = V.packed_layout(h, w, ws, shift, valid, META, torch.float32, align)
        keep = L.valid_token_mask(h, w, valid, META)
        L.zero_beyond_valid(torch.empty(4, 3, h, w, device=META), valid, 2, inplace=False)
    syncs.assert_none(len(PACKED_NAMES) + 2)  # one copy per tensor; the (B, 2) sizes once per call
    expected = V.packed_layout(h, w, ws, shift, valid, cpu, torch.float32, align)
    for name in PACKED_NAMES:
        t, e = getattr(packed, name), getattr(expected, name)
        assert t.device == META and t.dtype == e.dtype and t.shape == e.shape and t.stride() == e.stride(), name
    assert keep.device == META and keep.shape == (4, h, w)


@pytest.mark.parametrize("size,ws,shift", [((17, 23), 4, 2), ((13, 20), 7, 3), ((16, 16), 4, 0), ((9, 9), 3, 1)])
@pytest.mark.parametrize("align", [False, True])
def test_packed_layout_is_each_image_alone(size, ws, shift, align):
    # The packed windows of a batch are those of each image alone (mmdet's pad + roll +
    # partition of the image, and its mask), one image after the other; padding-only windows
    # of the batch are not in it; the inverse takes the windows back to the packed tokens.
    h, w = size
    valid = ((h, w), (h - 4, w), (3, 5), (h, w - 6), (h - 1, w - 1), (1, 1))
    cpu = torch.device("cpu")
    got = V.packed_layout(h, w, ws, shift, valid, cpu, torch.float64, align)
    x = torch.randn(len(valid), h, w, 2, dtype=torch.float64)
    packed = x.reshape(-1, 2).index_select(0, got.rows)[None]
    bound = dataclasses.replace(got, plan=plan_for(packed, grad=False))
    windows, masks = [], []
    for b, (vh, vw) in enumerate(valid):
        windows.append(reference_partition(x[b : b + 1, :vh, :vw].reshape(1, -1, 2), vh, vw, ws, shift))
        mask = W.window_attention_mask(vh, vw, ws, shift, True, cpu, torch.float64)
        n_windows = W.ceil_div(vh, ws) * W.ceil_div(vw, ws)
        masks.append(torch.zeros(n_windows, ws * ws, ws * ws, dtype=torch.float64) if mask is None else mask)
    expected = torch.cat(windows, 1)
    assert got.num_windows * ws * ws == expected.shape[1] and packed.shape[1] == sum(vh * vw for vh, vw in valid)
    assert got.num_windows < len(valid) * W.ceil_div(h, ws) * W.ceil_div(w, ws)  # padding-only windows left out
    torch.testing.assert_close(window_partition(packed, bound), expected, rtol=0, atol=0)
    torch.testing.assert_close(gather_tokens(expected, bound.inverse, False, None), packed, rtol=0, atol=0)
    torch.testing.assert_close(got.mask, torch.cat(masks), rtol=0, atol=0)
    n = ws * ws
    assert got.mask.stride()[-2:] == ((n + (-n) % 8 if align else n), 1)
    keep = L.valid_token_mask(h, w, valid, cpu)
    assert torch.equal(got.rows, keep.reshape(-1).nonzero().squeeze(1))  # every image's tokens, row-major


def test_package_clear_caches_clears_every_ops_cache():
    # One clear_caches() for every cache of the ops (layouts, indices, image windows, V2's
    # coordinates, the planner's decisions).
    import swin_backbone
    from swin_backbone.ops import cosine, planner

    caches = [L.get_window_layout, V.get_packed_layout, cosine.get_log_spaced_coords, planner._decide_cached]
    L.get_window_layout(14, 14, 7, 3, True, torch.device("cpu"), torch.float32, False)
    V.get_packed_layout(14, 14, 7, 3, ((14, 10), (9, 14)), torch.device("cpu"), torch.float32, False)
    cosine.get_log_spaced_coords(7, 0, torch.device("cpu"), torch.float32)
    planner.plan_for(torch.zeros(1))
    assert all(c.cache_info().currsize > 0 for c in caches), [c.cache_info() for c in caches]
    swin_backbone.clear_caches()
    assert [c.cache_info().currsize for c in caches] == [0] * len(caches)


def test_every_cache_of_the_ops_has_one_owner():
    # Every lru_cache in the ops' modules (directly, or inside a size_cache wrapper) is one
    # that clear_caches() empties: a new cache cannot be forgotten there.
    import functools
    import importlib
    import pkgutil

    import swin_backbone.ops as ops_package

    found = []
    for info in pkgutil.iter_modules(ops_package.__path__):
        module = importlib.import_module(f"swin_backbone.ops.{info.name}")
        for name, value in vars(module).items():
            cache = getattr(getattr(value, "cache_clear", None), "__self__", None)  # the lru_cache inside
            if isinstance(cache, functools._lru_cache_wrapper):
                found.append((f"{info.name}.{name}", cache))
    assert len(found) >= 6, found
    missing = [name for name, cache in found if not any(cache is c for c in L._CACHES)]
    assert not missing, missing


def test_traced_packed_layout_gathers_what_the_eager_one_does():
    # Compiled blocks get packed layouts whose padding slots read an appended zero token (no
    # pad_slots tensor, whose size dynamic shapes could equate with another): the same windows,
    # and the same tokens back.
    from swin_backbone.ops.attention import gather_tokens

    sizes = ((13, 20), (9, 11))
    for shift in (0, 3):
        eager = V.packed_layout(13, 20, 7, shift, sizes, torch.device("cpu"), torch.float32, False, 7)
        traced = V.packed_layout(13, 20, 7, shift, sizes, torch.device("cpu"), torch.float32, False, 7, traceable=True)
        assert eager.pad_slots is not None and traced.pad_slots is None and traced.traceable and traced.has_padding
        x = torch.randn(2, eager.width, 5)
        windows = gather_tokens(x, eager.index, eager.has_padding, eager.pad_slots)
        assert torch.equal(gather_tokens(x, traced.index, True, None, True), windows)
        assert torch.equal(gather_tokens(windows, traced.inverse, False, None, True), x)


@pytest.mark.parametrize("batch", [2, 3])
def test_batched_gather_reads_cached_rows(batch):
    # A batch gathers each map's tokens from one flat index whose per-map offsets are computed
    # once per layout and batch size (cached), not in every forward.
    from swin_backbone.ops import attention as A

    layout = L.get_window_layout(9, 12, 4, 2, True, torch.device("cpu"), torch.float32, False, False, 4)
    x = torch.randn(batch, 9 * 12, 5)
    windows = A.gather_tokens(x, layout.index, layout.has_padding, layout.pad_slots)
    for i in range(batch):
        assert torch.equal(windows[i:i + 1], A.gather_tokens(x[i:i + 1], layout.index, layout.has_padding,
                                                             layout.pad_slots))
    rows = A.get_batch_rows(layout.index, batch, 9 * 12)
    assert rows is A.get_batch_rows(layout.index, batch, 9 * 12)
    assert torch.equal(rows, layout.index + torch.arange(batch)[:, None] * (9 * 12))
    L.clear_caches()
    assert A.get_batch_rows.cache_info().currsize == 0
