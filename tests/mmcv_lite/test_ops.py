"""mmcv's compiled ops on mmcv-lite (``swin_backbone.mmcv_lite.ext``), called through mmcv's own
layers and autograd Functions, on every device of the machine: values and gradients against
pure-torch references written from mmcv's kernels (everywhere), against compiled mmcv (where it
is installed: the torch 2.1 stack), bf16 / fp16 inputs, and the error for an op not covered."""
import pytest
import torch

import swin_backbone  # noqa: F401,I001  (installs the mmcv._ext finder: a checkout has no .pth)
from mmcv.ops import DeformConv2dPack, ModulatedDeformConv2dPack, RoIAlign, batched_nms, modulated_deform_conv2d, nms
from mmcv.ops import sigmoid_focal_loss
from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

from swin_backbone.mmcv_lite.ext import NotCoveredError

from .common import (compiled_ext, lite_ext, ref_modulated_deform_conv, ref_ms_deform_attn, ref_nms, ref_roi_align,
                     use_ext)

#: Largest difference allowed against compiled mmcv 2.1.0, per op (values and gradients; float32).
#: NMS keeps the same indices. docs/mmcv-lite.md quotes these with the differences measured.
PARITY_TOL = {"roi_align": 1e-5, "modulated_deform_conv": 1e-4, "ms_deform_attn": 1e-5, "sigmoid_focal_loss": 1e-6}


@pytest.fixture
def lite():
    """mmcv's layers call the stand-in (on the main stack they already do; on a stack with
    compiled mmcv this routes them to it for the test)."""
    ext = lite_ext()
    with use_ext(ext):
        yield ext


@pytest.fixture
def compiled():
    ext = compiled_ext()
    if ext is None:
        pytest.skip("compiled mmcv is not installed here (mmcv-lite): parity runs on the torch 2.1 stack")
    return ext


# ----------------------------------------------------------------------------- inputs
def make_boxes(n, device, dtype=torch.float32, size=200.0):
    xy = torch.rand(n, 2) * size
    wh = torch.rand(n, 2) * size * 0.4 + 1
    return torch.cat([xy, xy + wh], 1).to(device, dtype), torch.rand(n).to(device, dtype)


def make_rois(device):
    feat = torch.randn(2, 8, 24, 32, device=device)
    xy = torch.rand(12, 2) * torch.tensor([120.0, 90.0]) - 8  # some boxes reach outside the image
    wh = torch.rand(12, 2) * 60 + 2
    rois = torch.cat([torch.randint(0, 2, (12, 1)).float(), xy, xy + wh], 1).to(device)
    return feat, rois


DCN_CASES = {  # (stride, padding, dilation, groups, deform_groups, offset from a 2x larger map)
    "3x3": (1, 1, 1, 1, 1, False),
    "stride2-dilation2-groups2-dg2": (2, 2, 2, 2, 2, False),
    # DyHead's spatial_conv_high: offsets of level l for the DCN of level l + 1 (half the size),
    # sliced from one offset-and-mask tensor
    "dyhead-offset-of-larger-level": (1, 1, 1, 1, 1, True),
}


def make_dcn(device, case, with_bias=True):
    stride, padding, dilation, groups, dg, larger = DCN_CASES[case]
    x = torch.randn(2, 8, 9, 11, device=device)
    weight = torch.randn(12, 8 // groups, 3, 3, device=device) * 0.2
    bias = torch.randn(12, device=device) if with_bias else None
    ho = (9 + 2 * padding - dilation * 2 - 1) // stride + 1
    wo = (11 + 2 * padding - dilation * 2 - 1) // stride + 1
    if larger:
        ho, wo = 2 * ho, 2 * wo
    both = torch.randn(2, 3 * dg * 9, ho, wo, device=device)
    offset = both[:, :2 * dg * 9] * 2  # samples between pixels and outside the image
    mask = both[:, 2 * dg * 9:].sigmoid()
    if larger:
        offset = both[:, :2 * dg * 9]  # a channel slice, as DyHead passes it
    return (x, offset, mask, weight, bias), (stride, padding, dilation, groups, dg)


def as_mmcv_reads(t, like):
    """mmcv's kernels read offset / mask per image as its first C x Ho x Wo values."""
    n, c = t.shape[:2]
    ho, wo = like.shape[-2:]
    return t.reshape(n, -1)[:, :c * ho * wo].reshape(n, c, ho, wo)


MSDA_SHAPES = [(6, 8), (3, 4)]


def make_msda(device):
    bs, heads, dims, queries, points = 2, 2, 4, 5, 3
    shapes = torch.tensor(MSDA_SHAPES, device=device)
    starts = torch.tensor([0, 48], device=device)
    value = torch.randn(bs, 60, heads, dims, device=device)
    loc = torch.rand(bs, queries, heads, len(MSDA_SHAPES), points, 2, device=device) * 1.2 - 0.1  # some outside
    attn = torch.rand(bs, queries, heads, len(MSDA_SHAPES), points, device=device).softmax(-1)
    return value, shapes, starts, loc, attn


def make_focal(device):
    x = torch.randn(64, 10, device=device) * 3
    t = torch.randint(0, 11, (64,), device=device)  # 10: background
    return x, t


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def leaves(*ts, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(t.is_floating_point()) for t in ts]


def close(a, b, tol, what):
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, b.double().abs().max().item() if b.numel() else 0.0)
    assert a.shape == b.shape and diff <= tol * scale, f"{what}: max difference {diff:.3g} > {tol} x {scale:.3g}"
    return diff


# ---------------------------------------------------------- mmcv-lite against references
@pytest.mark.parametrize("offset", [0, 1])
def test_nms_keeps_what_greedy_nms_keeps(device, lite, offset):
    boxes, scores = make_boxes(300, device, size=20.0)  # small boxes: the legacy +1 changes what is kept
    dets, keep = nms(boxes, scores, 0.5, offset=offset)
    assert torch.equal(keep.cpu(), ref_nms(boxes, scores, 0.5, offset))
    assert torch.equal(dets[:, 4], scores[keep]) and 20 < len(keep) < 300


def test_batched_nms_is_per_class(device, lite):
    boxes, scores = make_boxes(200, device)
    idxs = torch.randint(0, 3, (200,), device=device)
    _, keep = batched_nms(boxes, scores, idxs, dict(iou_threshold=0.4))
    want = torch.cat([torch.nonzero(idxs == c).flatten()[ref_nms(boxes[idxs == c], scores[idxs == c], 0.4).to(device)]
                      for c in range(3)])
    want = want[scores[want].argsort(descending=True)]
    assert torch.equal(keep, want)


@pytest.mark.parametrize("aligned,sampling_ratio", [(True, 0), (True, 2), (False, 0)])
def test_roi_align_values_and_grad(device, lite, aligned, sampling_ratio):
    feat, rois = make_rois(device)
    layer = RoIAlign((7, 6), spatial_scale=0.25, sampling_ratio=sampling_ratio, aligned=aligned)
    (x,) = leaves(feat)
    out = layer(x, rois)
    (xr,) = leaves(feat, dtype=torch.float64)
    ref = ref_roi_align(xr, rois, (7, 6), 0.25, sampling_ratio, aligned)
    close(out, ref, 1e-5, "roi_align")
    close(grads(out, x)[0], grads(ref, xr)[0], 1e-5, "roi_align grad")


@pytest.mark.parametrize("case", list(DCN_CASES))
def test_modulated_deform_conv_values_and_grads(device, lite, case):
    tensors, (stride, padding, dilation, groups, dg) = make_dcn(device, case)
    inputs = leaves(*tensors)
    out = modulated_deform_conv2d(*inputs, stride, padding, dilation, groups, dg)
    ref_inputs = leaves(*tensors, dtype=torch.float64)
    x, offset, mask, weight, bias = ref_inputs
    ref = ref_modulated_deform_conv(x, as_mmcv_reads(offset, out), as_mmcv_reads(mask, out), weight, bias, stride,
                                    padding, dilation, groups, dg)
    close(out, ref, 1e-5, "modulated_deform_conv")
    for name, g, gr in zip(("input", "offset", "mask", "weight", "bias"), grads(out, inputs), grads(ref, ref_inputs)):
        close(g, gr, 1e-5, f"modulated_deform_conv grad {name}")


def test_modulated_deform_conv_without_bias(device, lite):
    tensors, args = make_dcn(device, "3x3", with_bias=False)
    inputs = leaves(*tensors[:4])
    out = modulated_deform_conv2d(*inputs, None, *args)
    ref = ref_modulated_deform_conv(*leaves(*tensors, dtype=torch.float64), *args)
    close(out, ref, 1e-5, "modulated_deform_conv")
    assert all(g is not None and g.abs().sum() > 0 for g in grads(out, inputs))


def test_ms_deform_attn_values_and_grads(device, lite):
    value, shapes, starts, loc, attn = make_msda(device)
    inputs = leaves(value, loc, attn)
    out = MultiScaleDeformableAttnFunction.apply(inputs[0], shapes, starts, inputs[1], inputs[2], 64)
    ref_inputs = leaves(value, loc, attn, dtype=torch.float64)
    ref = ref_ms_deform_attn(ref_inputs[0], shapes, starts, ref_inputs[1], ref_inputs[2])
    close(out, ref, 1e-5, "ms_deform_attn")
    for name, g, gr in zip(("value", "sampling_locations", "attention_weights"), grads(out, inputs),
                           grads(ref, ref_inputs)):
        close(g, gr, 1e-5, f"ms_deform_attn grad {name}")


@pytest.mark.parametrize("with_weight", [False, True])
def test_sigmoid_focal_loss_values_and_grad(device, lite, with_weight):
    from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss

    x, t = make_focal(device)
    weight = torch.rand(10, device=device) if with_weight else None
    if with_weight:
        t = t.clamp(max=9)  # a class weight applies to rows with a class
    (xl,) = leaves(x)
    out = sigmoid_focal_loss(xl, t, 2.0, 0.25, weight, "none")
    (xr,) = leaves(x, dtype=torch.float64)
    onehot = torch.nn.functional.one_hot(t, 11)[:, :10].double()
    ref = py_sigmoid_focal_loss(xr, onehot, gamma=2.0, alpha=0.25, reduction="none")
    if with_weight:
        ref = ref * weight.double()[t].unsqueeze(1)
    close(out, ref, 1e-6, "sigmoid_focal_loss")
    close(grads(out, xl)[0], grads(ref, xr)[0], 1e-6, "sigmoid_focal_loss grad")
    mean = sigmoid_focal_loss(xl, t, 2.0, 0.25, weight, "mean")
    close(mean, ref.sum() / 64, 1e-6, "sigmoid_focal_loss mean")


# ------------------------------------------------------------------ bf16 / fp16 inputs
def _run_all(device, dtype, reference=False):
    """Every covered op on inputs rounded to ``dtype``: in ``dtype`` or, for the ``reference``,
    in float32 on the rounded values. {op: (output, input gradient)}."""
    def cast(t):
        return t.to(dtype).float() if reference else t.to(dtype)

    def lv(*ts):
        return leaves(*[None if t is None else cast(t) for t in ts])

    torch.manual_seed(0)
    results = {}
    boxes, scores = make_boxes(300, device)
    results["nms"] = (nms(cast(boxes), cast(scores), 0.5)[1], None)
    feat, rois = make_rois(device)
    (x,) = lv(feat)
    out = RoIAlign(7, 0.25, 0)(x, cast(rois))
    results["roi_align"] = (out, grads(out, x)[0])
    tensors, args = make_dcn(device, "3x3")
    inputs = lv(*tensors)
    out = modulated_deform_conv2d(*inputs, *args)
    results["modulated_deform_conv"] = (out, grads(out, inputs[0])[0])
    value, shapes, starts, loc, attn = make_msda(device)
    inputs = lv(value, loc, attn)
    out = MultiScaleDeformableAttnFunction.apply(inputs[0], shapes, starts, inputs[1], inputs[2], 64)
    results["ms_deform_attn"] = (out, grads(out, inputs[0])[0])
    x, t = make_focal(device)
    (xl,) = lv(x)
    out = sigmoid_focal_loss(xl, t, 2.0, 0.25, None, "none")
    results["sigmoid_focal_loss"] = (out, grads(out, xl)[0])
    return results


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs_compute_in_float32(device, lite, dtype):
    """bf16 / fp16 in, the same dtype out, equal to the float32 op on the same (rounded) inputs
    up to the output's rounding: the stand-in casts to float32 (mmcv's CPU NMS refuses bf16)."""
    low, ref = _run_all(device, dtype), _run_all(device, dtype, reference=True)
    for op, (out, grad) in low.items():
        ref_out, ref_grad = ref[op]
        if op == "nms":
            assert torch.equal(out, ref_out), op
            continue
        assert out.dtype == dtype and grad.dtype == dtype, op
        close(out.float(), ref_out, 1e-2, f"{op} in {dtype}")
        close(grad.float(), ref_grad, 1e-2, f"{op} grad in {dtype}")


def test_modulated_deform_conv_layer_under_cpu_bf16_autocast(lite):
    """DyHead's layer inside ``torch.autocast('cpu', bfloat16)`` (``tools/train.py --amp`` on the CPU)."""
    layer = ModulatedDeformConv2dPack(8, 8, 3, padding=1)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.1)
    x = torch.randn(2, 8, 10, 10, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    ref = layer(x.detach())
    close(out.float(), ref, 3e-2, "bf16 autocast DCNv2")
    assert torch.isfinite(x.grad).all() and layer.conv_offset.weight.grad.abs().sum() > 0


# -------------------------------------------------------------------------- not covered
def test_op_not_covered_names_op_module_and_remedy(lite):
    from mmdet.models.roi_heads.roi_extractors import SingleRoIExtractor

    extractor = SingleRoIExtractor(roi_layer=dict(type="RoIPool", output_size=7), out_channels=8, featmap_strides=[4])
    feat, rois = make_rois("cpu")
    with pytest.raises(NotCoveredError) as err:
        extractor([feat], rois)
    msg = str(err.value)
    for part in ("'roi_pool_forward'", "used by mmcv.ops.roi_pool", "install full mmcv", ", ".join(lite.OPS)):
        assert part in msg


def test_uncovered_mode_and_dcnv1_raise(lite):
    feat, rois = make_rois("cpu")
    with pytest.raises(NotCoveredError, match=r"pool_mode='max'.*used by mmcv.ops.roi_align"):
        RoIAlign(7, 0.25, 0, pool_mode="max")(feat, rois)
    with pytest.raises(NotCoveredError, match=r"'deform_conv_forward'.*used by mmcv.ops.deform_conv"):
        DeformConv2dPack(8, 8, 3, padding=1)(feat)


def test_the_table_is_what_is_served_and_a_misspelt_op_is_no_op(lite):
    import mmcv._ext

    assert all(getattr(lite, name) is fn for name, fn in lite.OPS.items())
    assert set(lite.OPS) <= set(lite.mmcv_ops())  # every served name is one mmcv asks for
    assert not hasattr(lite, "roi_align_forwrd")
    with pytest.raises(AttributeError, match=r"'roi_align_forwrd' is no op of mmcv.*did you mean 'roi_align_forward'"):
        lite.roi_align_forwrd
    with pytest.raises(NotCoveredError, match="'softnms'"):  # an op of mmcv not in the table
        lite.softnms()
    if compiled_ext() is None:  # mmcv-lite here: mmcv's own _ext is this module, whoever imported it first
        assert mmcv._ext is lite


# ------------------------------------------------------------- parity with compiled mmcv
def _both(compiled, fn):
    """``fn()`` with mmcv's layers on compiled mmcv, then on mmcv-lite; skips where compiled
    mmcv has no kernel for this device (mmcv 2.1.0 builds some ops for CUDA only)."""
    torch.manual_seed(0)
    try:
        with use_ext(compiled):
            a = fn()
    except (RuntimeError, NotImplementedError) as e:
        message = str(e).lower()
        if any(say in message for say in ("not implemented", "not compiled", "implementation for device")):
            pytest.skip(f"compiled mmcv has no kernel for this op on this device: {str(e).splitlines()[0]}")
        raise
    torch.manual_seed(0)
    with use_ext(lite_ext()):
        b = fn()
    return a, b


def _report(op, diffs):
    print(f"parity {op}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


def test_parity_nms(device, compiled):
    def run():
        boxes, scores = make_boxes(1000, device)
        return [nms(boxes, scores, thr, offset=off)[1] for thr in (0.3, 0.5, 0.7) for off in (0, 1)]

    a, b = _both(compiled, run)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_parity_nms_with_equal_scores(device, compiled):
    """Many boxes share a score (as identical RPN proposals do): kept in mmcv's order, the order
    the RoI sampler then draws from."""
    def run():
        boxes, scores = make_boxes(1000, device)
        scores = (scores * 8).floor() / 8  # 8 distinct scores
        boxes = torch.cat([boxes, boxes[:200]])  # and identical boxes with the same score
        scores = torch.cat([scores, scores[:200]])
        return [nms(boxes, scores, thr)[1] for thr in (0.3, 0.7)]

    a, b = _both(compiled, run)
    for x, y in zip(a, b):
        assert len(x) > 50 and torch.equal(x, y)


def _grad_outputs(op, fn):
    def run():
        out, inputs = fn()
        return [out.detach()] + [g for g in grads(out, inputs) if g is not None]

    return run


def _parity(compiled, op, fn, names):
    a, b = _both(compiled, _grad_outputs(op, fn))
    assert len(a) == len(b) == len(names), (op, len(a), len(b), names)  # zip would drop the rest
    diffs = {name: close(y, x, PARITY_TOL[op], f"{op} {name}") for name, x, y in zip(names, a, b)}
    _report(op, diffs)


@pytest.mark.parametrize("aligned,sampling_ratio", [(True, 0), (True, 2), (False, 0)])
def test_parity_roi_align(device, compiled, aligned, sampling_ratio):
    def fn():
        feat, rois = make_rois(device)
        (x,) = leaves(feat)
        return RoIAlign((7, 6), 0.25, sampling_ratio, aligned=aligned)(x, rois), [x]

    _parity(compiled, "roi_align", fn, ["output", "grad input"])


@pytest.mark.parametrize("case", list(DCN_CASES))
def test_parity_modulated_deform_conv(device, compiled, case):
    def fn():
        tensors, args = make_dcn(device, case)
        inputs = leaves(*tensors)
        return modulated_deform_conv2d(*inputs, *args), inputs

    _parity(compiled, "modulated_deform_conv", fn, ["output", "grad input", "grad offset", "grad mask",
                                                     "grad weight", "grad bias"])


def test_parity_ms_deform_attn(device, compiled):
    def fn():
        value, shapes, starts, loc, attn = make_msda(device)
        inputs = leaves(value, loc, attn)
        return MultiScaleDeformableAttnFunction.apply(inputs[0], shapes, starts, inputs[1], inputs[2], 64), inputs

    _parity(compiled, "ms_deform_attn", fn, ["output", "grad value", "grad sampling_locations",
                                              "grad attention_weights"])


def test_parity_sigmoid_focal_loss(device, compiled):
    def fn():
        x, t = make_focal(device)
        (xl,) = leaves(x)
        return sigmoid_focal_loss(xl, t, 2.0, 0.25, None, "none"), [xl]

    _parity(compiled, "sigmoid_focal_loss", fn, ["output", "grad input"])
