"""SwinBackbone.forward(x, valid_sizes): each image's features equal those of the image run
alone at its exact size, whatever the batch and its padding (eval and training), and the
per-image window arithmetic behind it."""
from typing import List, Sequence, Tuple

import pytest
import torch

from swin_backbone import SwinBackbone, ops
from swin_backbone.model.valid_sizes import attach_valid_sizes, read_valid_sizes
from swin_backbone.ops import layouts as L, windows as W

from ..helpers import DeviceSyncs

# window 4 keeps maps of several windows small; sizes hit odd sizes at every stage, images
# whose last stages are below one window, and images that fill one axis of the batch.
CFG = dict(arch=None, embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
BATCHES = {
    # the 600x901 with 777x650 in an 800x928 batch, scaled down by 8
    "issue-like": ((100, 116), [(75, 113), (97, 81)]),
    "mixed": ((64, 72), [(45, 61), (30, 29), (9, 7), (64, 50)]),
    "tiny": ((40, 36), [(3, 5), (40, 17)]),
}


def _model(**kw) -> SwinBackbone:
    torch.manual_seed(0)
    model = SwinBackbone(**dict(CFG, **kw))
    model.init_weights()
    return model


def _batch(size: Tuple[int, int], sizes: Sequence[Tuple[int, int]], dtype=torch.float32):
    """Images, and a batch holding them top-left with *non-zero* garbage beyond each (the
    backbone must not read it)."""
    images = [torch.randn(1, 3, h, w, dtype=dtype) for h, w in sizes]
    batch = torch.randn(len(sizes), 3, *size, dtype=dtype) * 3 + 1
    for i, img in enumerate(images):
        batch[i, :, : img.shape[2], : img.shape[3]] = img[0]
    return images, batch


def _assert_image_exact(outs, alone: List[Tuple[torch.Tensor, ...]], atol=1e-4):
    for i, image_outs in enumerate(alone):
        for stage, (got, ref) in enumerate(zip(outs, image_outs)):
            h, w = ref.shape[-2:]
            torch.testing.assert_close(got[i, :, :h, :w], ref[0], rtol=1e-4, atol=atol, msg=f"image {i} stage {stage}")
            beyond = got[i].clone()
            beyond[:, :h, :w] = 0
            assert beyond.abs().max() == 0, f"image {i} stage {stage}: non-zero beyond its valid size"


def test_v2_batch_equals_each_image_alone():
    # Swin V2 shares the stages, layouts and merging masks: the same exactness holds.
    from swin_backbone import SwinV2Backbone

    torch.manual_seed(0)
    model = SwinV2Backbone(**dict(CFG, window_size=4), pad_small_map=True).eval()
    model.init_weights()
    with torch.no_grad():  # post-norms start at zero: make them non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    size, sizes = BATCHES["issue-like"]
    images, batch = _batch(size, sizes)
    with torch.no_grad():
        outs = model(batch, valid_sizes=sizes)
        alone = [model(img) for img in images]
    _assert_image_exact(outs, alone)


# ---------------------------------------------------------------- eval
@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize(
    "strategy",
    [
        dict(),  # CPU default: SDPA with per-window biases, row chunks
        dict(chunk_bytes=0),  # whole tensors
        dict(sdpa=False),  # matmul + softmax
    ],
    ids=["default", "whole", "matmul"],
)
def test_eval_batch_equals_each_image_alone(name, strategy):
    size, sizes = BATCHES[name]
    model = _model().eval()
    images, batch = _batch(size, sizes)
    with torch.no_grad(), ops.override(**strategy):
        outs = model(batch, valid_sizes=sizes)
        alone = [model(img) for img in images]
        plain = model(batch)
    _assert_image_exact(outs, alone)
    # without valid_sizes the padding is ordinary tokens: the test can fail
    i = next(i for i, s in enumerate(sizes) if s != size)
    h, w = alone[i][1].shape[-2:]
    assert not torch.allclose(plain[1][i, :, :h, :w], alone[i][1][0], atol=1e-3)


def test_valid_sizes_as_tensor_and_with_options():
    size, sizes = BATCHES["mixed"]
    images, batch = _batch(size, sizes)
    for kw in (dict(channels_last_outputs=True), dict(use_abs_pos_embed=True, pretrain_img_size=32), dict(out_indices=(1, 2))):
        model = _model(**kw).eval()
        with torch.no_grad():
            outs = model(batch, valid_sizes=torch.tensor(sizes, dtype=torch.int32))
            alone = [model(img) for img in images]
        _assert_image_exact(outs, alone)


def test_full_valid_sizes_equal_none():
    model = _model().eval()
    x = torch.randn(2, 3, 45, 61)
    with torch.no_grad():
        ref = model(x)
        for valid in ([(45, 61), (45, 61)], torch.tensor([[45, 61], [45, 61]])):
            for a, b in zip(model(x, valid_sizes=valid), ref):
                assert torch.equal(a, b)


def _rows_reaching(model, x, **kw):
    """Per block, the token rows its ``attn.qkv`` and ``mlp.fc1`` Linears were handed in one forward."""
    rows = {}

    def recorder(name):
        def hook(module, args, output):
            rows[name] = rows.get(name, 0) + args[0].numel() // args[0].shape[-1]
        return hook

    handles = [m.register_forward_hook(recorder(n)) for n, m in model.named_modules()
               if n.endswith(("attn.qkv", "mlp.fc1"))]
    try:
        with torch.no_grad():
            model(x, **kw)
    finally:
        for handle in handles:
            handle.remove()
    return rows


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_padding_only_windows_are_not_computed(version):
    # An image-exact batch computes each image's own windows and nothing else: the rows reaching
    # every block's qkv projection (tokens of the windows, their padding slots included) and
    # MLP (real tokens) are those of the images run alone, summed, not those of the padded batch.
    # Sizes: odd ones, one smaller than a window at stage 0, one that fills the batch.
    from swin_backbone import SwinV2Backbone

    size, sizes = (45, 61), [(45, 61), (30, 13), (9, 7)]
    if version == "v1":
        model = _model().eval()
    else:
        torch.manual_seed(0)
        model = SwinV2Backbone(**dict(CFG, window_size=4), pad_small_map=True).eval()
    images, batch = _batch(size, sizes)
    got = _rows_reaching(model, batch, valid_sizes=sizes)
    alone = [_rows_reaching(model, img) for img in images]
    padded = _rows_reaching(model, batch)
    assert len(got) == 2 * sum(CFG["depths"]) and got.keys() == padded.keys()
    for name in got:
        assert got[name] == sum(a[name] for a in alone), name
    # the check can fail: the padded batch computes more rows at every block (at the last stage,
    # one window per image either way, the same qkv rows)
    assert all(got[name] <= padded[name] for name in got)
    assert all(got[name] < padded[name] for name in got if name.startswith("stages.0.") or "fc1" in name)


# ---------------------------------------------------------------- training
def _loss(outs, weights, i=None):
    """Sum of features times fixed random weights; ``i``: image ``i`` of a batch."""
    total = 0
    for out, wt in zip(outs, weights):
        if i is None:
            total = total + (out * wt[..., : out.shape[-2], : out.shape[-1]]).sum()
        else:
            total = total + (out * wt[i : i + 1, :, : out.shape[-2], : out.shape[-1]]).sum()
    return total


@pytest.mark.parametrize(
    "variant",
    ["recompute", "recompute-chunked", "autograd", "frozen-abs-pos", "with-cp", "v2"],
)
def test_training_gradients_equal_sum_over_images_alone(variant):
    # (image 3 fills the batch; image 2 is smaller than a window at stage 0)
    size, sizes = (40, 44), [(37, 21), (15, 44), (3, 2), (40, 44)]
    kw = dict(use_abs_pos_embed=True, pretrain_img_size=32, frozen_stages=1) if variant == "frozen-abs-pos" else {}
    kw = dict(with_cp=True) if variant == "with-cp" else kw
    if variant == "v2":
        from swin_backbone import SwinV2Backbone

        torch.manual_seed(0)
        model = SwinV2Backbone(**dict(CFG, window_size=4), pad_small_map=True).double().train()
        with torch.no_grad():  # post-norms start at zero: make them non-trivial
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    else:
        model = _model(**kw).double().train()
    images, batch = _batch(size, sizes, torch.float64)
    with torch.no_grad():
        shapes = [o.shape for o in model(batch)]
    weights = [torch.randn(len(sizes), s[1], s[2], s[3], dtype=torch.float64) for s in shapes]
    switches = dict(
        recompute=dict(chunk_bytes=0),
        **{"recompute-chunked": dict(chunk_bytes=2 * 2 * 16 * 16 * 8)},  # backward groups of one window
        autograd=dict(recompute_attention=False, save_memory=False),
        **{"frozen-abs-pos": {}, "with-cp": {}, "v2": {}},
    )[variant]
    params = [p for p in model.parameters() if p.requires_grad]
    with ops.override(**switches):
        model.zero_grad()
        _loss(model(batch, valid_sizes=sizes), weights).backward()
        got = [p.grad.clone() for p in params]
        model.zero_grad()
        for i, img in enumerate(images):
            _loss(model(img), weights, i).backward()
        expected = [p.grad.clone() for p in params]
    for p, g, e in zip([n for n, p in model.named_parameters() if p.requires_grad], got, expected):
        torch.testing.assert_close(g, e, rtol=1e-7, atol=1e-9, msg=p)


def test_training_input_gradient_stays_inside_images():
    size, sizes = (32, 36), [(21, 36), (9, 13)]
    model = _model().double().train()
    images, batch = _batch(size, sizes, torch.float64)
    batch.requires_grad_(True)
    sum(o.sum() for o in model(batch, valid_sizes=sizes)).backward()
    grad = batch.grad
    assert grad[1, :, 9:].abs().max() == 0 and grad[1, :, :, 13:].abs().max() == 0
    alone = images[1].clone().requires_grad_(True)
    sum(o.sum() for o in model(alone)).backward()
    torch.testing.assert_close(grad[1:2, :, :9, :13], alone.grad, rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    "bad, match",
    [
        ([(10, 10)], "2 \\(h, w\\) int pairs"),  # wrong length
        ([(10, 10), (33, 10)], "1 <= h <= 32"),  # larger than the input
        ([(10, 10), (10, 41)], "1 <= w <= 40"),
        ([(0, 10), (10, 10)], "valid_sizes"),  # zero
        ([(10, 10), (-3, 10)], "valid_sizes"),  # negative
        ([(10.0, 10), (10, 10)], "valid_sizes"),  # floats
        ([(10, 10, 3), (10, 10)], "valid_sizes"),  # not pairs
        ("abc", "valid_sizes"),
        (12, "valid_sizes"),
        (torch.tensor([[10.0, 10.0], [10.0, 10.0]]), "integer tensor"),
        (torch.tensor([10, 10]), "shape \\(2,\\)"),
        ([(True, 10), (10, 10)], "valid_sizes"),
    ],
)
def test_bad_valid_sizes_raise(bad, match):
    model = _model().eval()
    with pytest.raises(ValueError, match=f"^valid_sizes: expected .*{match}" if match != "valid_sizes" else "^valid_sizes: expected"):
        model(torch.randn(2, 3, 32, 40), valid_sizes=bad)


@pytest.mark.parametrize("kw, match", [(dict(mask_padding=False), "mask_padding=True"), (dict(pad_small_map=False), "pad_small_map=True")])
def test_valid_sizes_need_masked_padding_and_padded_small_maps(kw, match):
    model = _model(**kw).eval()
    with pytest.raises(ValueError, match=f"^valid_sizes: needs {match}"):
        model(torch.randn(2, 3, 32, 40), valid_sizes=[(32, 40), (20, 40)])


# ---------------------------------------------------------------- attached sizes
def test_attached_sizes_follow_the_batch_and_its_crops():
    batch = attach_valid_sizes(torch.zeros(2, 3, 20, 30), [(12, 30), (20, 7)])
    assert read_valid_sizes(batch) == ((12, 30), (20, 7))
    crop = batch[:, :, 8:18, 5:25]  # mmseg slide inference
    assert read_valid_sizes(crop) == ((4, 20), (10, 2))
    assert read_valid_sizes(batch[:, :, 14:20, 10:30]) == ((6, 20), (6, 20))  # image 1 absent: whole crop
    assert read_valid_sizes(batch.clone()) is None  # a copy carries nothing
    assert read_valid_sizes(batch[:1]) is None  # not a crop of the whole batch
    assert read_valid_sizes(torch.zeros(2, 3, 20, 30)) is None


def test_backbone_reads_attached_sizes():
    size, sizes = BATCHES["tiny"]
    model = _model().eval()
    _, batch = _batch(size, sizes)
    with torch.no_grad():
        explicit = model(batch, valid_sizes=sizes)
        attached = model(attach_valid_sizes(batch.clone(), sizes))
    for a, b in zip(explicit, attached):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- no host-device syncs
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("align", [False, True])
def test_forward_never_waits_for_the_device(train, align):
    # On the meta device any read of a device value (nonzero, item) raises, and the
    # recorder sees every sync and every CPU -> device copy: a whole forward (and backward)
    # with per-image sizes builds its layouts, image windows and masks without waiting.
    L.clear_caches()  # every layout and image window built in this forward
    model = _model().to("meta").train(train)
    size, sizes = BATCHES["mixed"]
    x = torch.empty(len(sizes), 3, *size, device="meta")
    with DeviceSyncs() as syncs, ops.override(align_masks=align), torch.set_grad_enabled(train):
        outs = model(x, valid_sizes=sizes)
        if train:
            sum(o.sum() for o in outs).backward()
    syncs.assert_none()
    assert len(syncs.copies) > 10  # layouts and image windows of every stage were built here
    assert [tuple(o.shape[-2:]) for o in outs] == list(W.output_size(*size, 4, 4))
