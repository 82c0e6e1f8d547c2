"""Hostile tensor inputs: SwinBackbone.forward (rank, layout, dtype, device, empty, non-finite,
valid_sizes) and FeatureExtractor (constructor arguments and the images it is called with:
HWC tensors, 0..1 floats, 16-bit values, paths, PIL images, a single image instead of a list).
Bad rows fail before the forward with a ``ValueError`` naming the argument; good rows give
the correct result (compared with the plain uint8 / NCHW input)."""
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from swin_backbone import SwinBackbone
from swin_backbone.features import FeatureExtractor

from .rows import bad, good, params, run_row

TINY = dict(arch=None, embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8), drop_path_rate=0.0)
E = ValueError

torch.manual_seed(0)
MODEL = SwinBackbone(**TINY).eval()
MODEL.init_weights()
FX = FeatureExtractor(MODEL, batch_size=2)
RNG = np.random.RandomState(0)
IMAGE = RNG.randint(0, 256, (20, 28, 3), dtype=np.uint8)  # (H, W, 3) uint8 RGB
REF = None


def reference():
    global REF
    if REF is None:
        REF = FX([IMAGE])[0]
    return REF


def same_as_reference(result, atol=1e-5):
    ref = reference()
    assert len(result) == 1 and sorted(result[0]) == sorted(ref)
    for s in ref:
        torch.testing.assert_close(result[0][s], ref[s], rtol=1e-5, atol=atol)


def forward(x, **kw):
    return lambda: MODEL(x, **kw)


def fx_call(images):
    return lambda: FX(images)


def fx_new(**kw):
    return lambda: FeatureExtractor(MODEL, **kw)


X = torch.randn(2, 3, 32, 32)
CHW = torch.from_numpy(IMAGE).permute(2, 0, 1).contiguous()

FORWARD_ROWS = [
    bad("forward-2d", forward(torch.randn(32, 32)), E, "input", "4-D"),
    bad("forward-3d", forward(torch.randn(3, 32, 32)), E, "input", "4-D"),
    bad("forward-5d", forward(torch.randn(1, 1, 3, 32, 32)), E, "input", "4-D"),
    bad("forward-nhwc", forward(torch.randn(1, 32, 32, 3)), E, "input", "3 channels", "permute"),
    bad("forward-one-channel", forward(torch.randn(1, 1, 32, 32)), E, "input", "in_channels"),
    bad("forward-four-channels", forward(torch.randn(1, 4, 32, 32)), E, "input", "in_channels"),
    bad("forward-empty-batch", forward(torch.randn(0, 3, 32, 32)), E, "input", ">= 1"),
    bad("forward-zero-height", forward(torch.randn(1, 3, 0, 32)), E, "input", ">= 1"),
    bad("forward-uint8", forward(torch.zeros(1, 3, 32, 32, dtype=torch.uint8)), E, "input", "floating-point"),
    bad("forward-int64", forward(torch.zeros(1, 3, 32, 32, dtype=torch.int64)), E, "input", "floating-point"),
    bad("forward-bool", forward(torch.zeros(1, 3, 32, 32, dtype=torch.bool)), E, "input", "floating-point"),
    bad("forward-complex", forward(torch.zeros(1, 3, 32, 32, dtype=torch.complex64)), E, "input", "floating-point"),
    bad("forward-float64", forward(torch.zeros(1, 3, 32, 32, dtype=torch.float64)), E, "input", "dtype"),
    bad("forward-bf16-into-fp32", forward(torch.zeros(1, 3, 32, 32, dtype=torch.bfloat16)), E, "input", "dtype"),
    bad("forward-meta-device", forward(torch.zeros(1, 3, 32, 32, device="meta")), E, "input", "device"),
    bad("forward-numpy", forward(np.zeros((1, 3, 32, 32), np.float32)), E, "input", "torch.Tensor"),
    bad("forward-list", forward([[0.0]]), E, "input", "torch.Tensor"),
    bad("forward-none", forward(None), E, "input", "torch.Tensor"),
    good("forward-nan-propagates-locally", forward(torch.where(torch.arange(32 * 32).view(1, 1, 32, 32) == 0,
                                                               float("nan"), X[:1])),
         lambda outs: (not torch.isfinite(outs[0]).all()) and torch.isfinite(outs[0][..., -1, -1]).all()),
    good("forward-requires-grad", forward(X.clone().requires_grad_()), lambda outs: outs[0].requires_grad),
    good("forward-1x1-image", forward(torch.randn(1, 3, 1, 1)), lambda outs: outs[3].shape == (1, 128, 1, 1)),
    # valid_sizes
    bad("valid_sizes-wrong-length", forward(X, valid_sizes=[(32, 32)]), E, "valid_sizes", "2 (h, w)"),
    bad("valid_sizes-float-tensor", forward(X, valid_sizes=torch.ones(2, 2) * 8), E, "valid_sizes", "integer"),
    bad("valid_sizes-bool-tensor", forward(X, valid_sizes=torch.ones(2, 2, dtype=torch.bool)), E, "valid_sizes"),
    bad("valid_sizes-tensor-shape", forward(X, valid_sizes=torch.ones(2, 3, dtype=torch.long)), E, "valid_sizes"),
    bad("valid_sizes-zero", forward(X, valid_sizes=[(0, 5), (32, 32)]), E, "valid_sizes", "1 <= h"),
    bad("valid_sizes-negative", forward(X, valid_sizes=[(-1, 5), (32, 32)]), E, "valid_sizes"),
    bad("valid_sizes-too-large", forward(X, valid_sizes=[(33, 32), (32, 32)]), E, "valid_sizes", "<= 32"),
    bad("valid_sizes-floats", forward(X, valid_sizes=[(8.0, 8.0), (32, 32)]), E, "valid_sizes", "int pairs"),
    bad("valid_sizes-triples", forward(X, valid_sizes=[(8, 8, 8), (32, 32)]), E, "valid_sizes"),
    bad("valid_sizes-string", forward(X, valid_sizes="32x32"), E, "valid_sizes"),
    bad("valid_sizes-bools", forward(X, valid_sizes=[(True, True), (32, 32)]), E, "valid_sizes"),
    good("valid_sizes-full-size-is-plain", forward(X, valid_sizes=[(32, 32), (32, 32)]),
         lambda outs: all(torch.allclose(a, b, atol=1e-5) for a, b in zip(outs, MODEL(X)))),
]

EXTRACTOR_ROWS = [
    # constructor
    bad("fx-backbone-str", lambda: FeatureExtractor("tiny"), E, "backbone", "nn.Module", "from_arch"),
    bad("fx-backbone-none", lambda: FeatureExtractor(None), E, "backbone", "nn.Module"),
    bad("fx-stages-out-of-range", fx_new(stages=[7]), E, "stages", "< 4"),
    bad("fx-stages-negative", fx_new(stages=[-1]), E, "stages", ">= 0"),
    bad("fx-stages-duplicate", fx_new(stages=[0, 0]), E, "stages", "each once"),
    bad("fx-stages-empty", fx_new(stages=[]), E, "stages", "non-empty"),
    bad("fx-stages-int", fx_new(stages=2), E, "stages", "list"),
    bad("fx-stages-str", fx_new(stages="0"), E, "stages"),
    bad("fx-stages-float", fx_new(stages=[1.0]), E, "stages"),
    bad("fx-stages-bool", fx_new(stages=[True]), E, "stages"),
    good("fx-stages-tuple", fx_new(stages=(3, 0)), lambda fx: fx.stages == [3, 0]),
    bad("fx-mean-two", fx_new(mean=(1.0, 2.0)), E, "mean", "3 numbers"),
    bad("fx-mean-str", fx_new(mean="abc"), E, "mean", "3 numbers"),
    bad("fx-mean-nan", fx_new(mean=(float("nan"), 0, 0)), E, "mean[0]", "finite"),
    bad("fx-std-zero", fx_new(std=(0, 1, 1)), E, "std[0]", "> 0"),
    bad("fx-std-negative", fx_new(std=(1, -1, 1)), E, "std[1]", "> 0"),
    bad("fx-std-inf", fx_new(std=(1, 1, float("inf"))), E, "std[2]", "finite"),
    bad("fx-resize-zero", fx_new(resize=(0, 10)), E, "resize[0]", ">= 1"),
    bad("fx-resize-negative", fx_new(resize=(10, -5)), E, "resize[1]", ">= 1"),
    bad("fx-resize-one-value", fx_new(resize=(10,)), E, "resize", "(H, W)"),
    bad("fx-resize-float", fx_new(resize=(10.5, 10)), E, "resize[0]", "int"),
    bad("fx-resize-str", fx_new(resize="64"), E, "resize"),
    bad("fx-batch_size-zero", fx_new(batch_size=0), E, "batch_size", ">= 1"),
    bad("fx-batch_size-negative", fx_new(batch_size=-1), E, "batch_size", ">= 1"),
    bad("fx-batch_size-float", fx_new(batch_size=1.5), E, "batch_size", "int"),
    bad("fx-batch_size-bool", fx_new(batch_size=True), E, "batch_size", "int"),
    bad("fx-batch_size-str", fx_new(batch_size="4"), E, "batch_size", "int"),
    bad("fx-device-banana", fx_new(device="banana"), E, "device", "'cpu', 'cuda'"),
    bad("fx-device-int", fx_new(device=[0]), E, "device"),
    bad("fx-device-cuda-index", fx_new(device="cuda:99"), E, "device"),
    bad("fx-device-mps-like", fx_new(device="meta"), E, "device", "'cpu', 'cuda'"),
    bad("fx-dtype-name", fx_new(dtype="float32"), E, "dtype", "fp32"),
    bad("fx-dtype-torch", fx_new(dtype=torch.float32), E, "dtype", "fp32"),
    bad("fx-mixed_sizes-str", fx_new(mixed_sizes="yes"), E, "mixed_sizes", "True or False"),
    good("fx-device-torch-device", fx_new(device=torch.device("cpu")), lambda fx: fx.device.type == "cpu"),
    # the images it is called with
    bad("fx-hwc-tensor", fx_call([torch.from_numpy(IMAGE)]), E, "images[0]", "(3, H, W)", "permute(2, 0, 1)"),
    bad("fx-chw-array", fx_call([IMAGE.transpose(2, 0, 1).copy()]), E, "images[0]", "transpose(1, 2, 0)"),
    bad("fx-four-channel-tensor", fx_call([torch.zeros(4, 20, 28)]), E, "images[0]", "(3, H, W)"),
    bad("fx-one-channel-tensor", fx_call([torch.zeros(1, 20, 28)]), E, "images[0]", "(3, H, W)"),
    bad("fx-2d-tensor", fx_call([torch.zeros(20, 28)]), E, "images[0]", "(3, H, W)"),
    bad("fx-five-channel-array", fx_call([np.zeros((20, 28, 5), np.uint8)]), E, "images[0]", "(H, W, 3)"),
    bad("fx-1d-array", fx_call([np.zeros(20, np.uint8)]), E, "images[0]", "(H, W, 3)"),
    bad("fx-single-array-not-a-list", fx_call(IMAGE), E, "images", "[image]"),
    bad("fx-single-tensor-not-a-list", fx_call(CHW), E, "images", "[image]"),
    bad("fx-path-string", fx_call(["photo.jpg"]), E, "images[0]", "read_rgb"),
    bad("fx-pil-image", fx_call([Image.fromarray(IMAGE)]), E, "images[0]", "read_rgb"),
    bad("fx-none-image", fx_call([None]), E, "images[0]"),
    bad("fx-not-iterable", fx_call(5), E, "images", "list"),
    bad("fx-bool-array", fx_call([IMAGE > 127]), E, "images[0]", "uint8"),
    bad("fx-complex-tensor", fx_call([CHW.to(torch.complex64)]), E, "images[0]", "uint8"),
    bad("fx-16-bit-array", fx_call([IMAGE.astype(np.uint16) * 257]), E, "images[0]", "0..255", "16-bit"),
    bad("fx-negative-int-array", fx_call([IMAGE.astype(np.int64) - 128]), E, "images[0]", "0..255"),
    bad("fx-nan-image", fx_call([np.full((20, 28, 3), np.nan, np.float32)]), E, "images[0]", "finite"),
    bad("fx-inf-image", fx_call([CHW.float().index_fill(1, torch.tensor([0]), float("inf"))]), E, "images[0]", "finite"),
    bad("fx-empty-image", fx_call([np.zeros((0, 28, 3), np.uint8)]), E, "images[0]", ">= 1"),
    bad("fx-empty-tensor", fx_call([torch.zeros(3, 20, 0)]), E, "images[0]", ">= 1"),
    bad("fx-meta-tensor", fx_call([torch.zeros(3, 20, 28, device="meta")]), E, "images[0]", "meta"),
    bad("fx-second-image-bad", fx_call([IMAGE, torch.from_numpy(IMAGE)]), E, "images[1]"),
    good("fx-chw-tensor-uint8", fx_call([CHW]), same_as_reference),
    good("fx-float-0-255", fx_call([IMAGE.astype(np.float32)]), same_as_reference),
    good("fx-int64-in-range", fx_call([IMAGE.astype(np.int64)]), same_as_reference),
    good("fx-rgba-drops-alpha", fx_call([np.concatenate([IMAGE, np.zeros((20, 28, 1), np.uint8)], 2)]),
         same_as_reference),
    good("fx-non-contiguous", fx_call([np.ascontiguousarray(IMAGE[:, ::-1])[:, ::-1]]), same_as_reference),
    good("fx-grey-array", fx_call([IMAGE[:, :, 0]]),
         lambda r: torch.allclose(r[0][0], FX([np.repeat(IMAGE[:, :, :1], 3, 2)])[0][0])),
    good("fx-empty-list", fx_call([]), lambda r: r == []),
    good("fx-4d-batch-tensor", fx_call(CHW[None].repeat(2, 1, 1, 1)),
         lambda r: len(r) == 2 and torch.allclose(r[1][3], reference()[3], atol=1e-5)),
    good("fx-generator", fx_call(im for im in [IMAGE]), same_as_reference),
]


@pytest.mark.parametrize("row", params(FORWARD_ROWS + EXTRACTOR_ROWS))
def test_tensor_input_row(row):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a good row must not warn either
        run_row(row)


def test_float_images_in_0_1_warn_and_say_how_to_fix():
    scaled = IMAGE.astype(np.float32) / 255
    with pytest.warns(UserWarning, match=r"images\[0\]: float values in \[0, 1\].*multiply by 255"):
        wrong = FX([scaled])[0]
    assert (wrong[0] - reference()[0]).abs().max() > 0.1  # they really are other features
    with pytest.warns(UserWarning, match=r"images\[0\].*already|outside 0..255"):
        FX([(IMAGE.astype(np.float32) - 120) / 60])


def test_stages_beyond_a_backbone_without_out_indices_fail_at_the_first_batch():
    class Plain(torch.nn.Module):
        def forward(self, x):
            return (x.mean(1, keepdim=True),)

    fx = FeatureExtractor(Plain(), stages=[2])
    with pytest.raises(ValueError, match=r"stages.*< 1"):
        fx([IMAGE])
