"""Robustness: the bad-input battery, precision, determinism and cache keying, compile and
export with dynamic sizes. One case per input; the README lists the battery."""
import pytest
import torch

from swin_backbone import SwinBackbone
from swin_backbone.ops import layouts as L, windows as W

from ..helpers import small_arch


@pytest.fixture(scope="module")
def model():
    m = SwinBackbone(**small_arch())
    m.init_weights()
    return m.eval()


def _run(model, x):
    with torch.no_grad():
        return model(x)


# ---------------------------------------------------------------- inputs that work
@pytest.mark.parametrize("size", [(1, 1), (2, 2), (16, 2048), (2048, 16), (5, 3)])
def test_tiny_and_extreme_sizes(model, size):
    outs = _run(model, torch.randn(1, 3, *size))
    assert [tuple(o.shape[-2:]) for o in outs] == list(W.output_size(*size, 4, 4))
    assert all(torch.isfinite(o).all() for o in outs)


def test_non_contiguous_and_channels_last_inputs_give_the_same_result(model):
    x = torch.randn(2, 3, 37, 53)
    ref = _run(model, x)
    variants = {
        "channels_last": x.contiguous(memory_format=torch.channels_last),
        "transposed view": x.transpose(2, 3).contiguous().transpose(2, 3),
        "strided slice": torch.randn(2, 3, 74, 106)[:, :, ::2, ::2].copy_(x),
    }
    for name, v in variants.items():
        assert not v.is_contiguous() or name == "channels_last"
        for a, b in zip(_run(model, v), ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_nan_and_inf_propagate_without_hanging(model):
    # Documented behaviour: values are not scanned (that would cost a pass over every
    # input); non-finite pixels make the windows that see them non-finite, and the call
    # returns normally with the right shapes.
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 3, 64, 64)
        x[0, 0, 5, 5] = bad
        outs = _run(model, x)
        assert [o.shape for o in outs] == [o.shape for o in _run(model, torch.randn(1, 3, 64, 64))]
        assert not torch.isfinite(outs[0]).all()
        assert torch.isfinite(outs[0][..., -4:, -4:]).all()  # a far-away window is untouched at stage 0


# ---------------------------------------------------------------- inputs that are refused
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: torch.randn(3, 32, 32), "4-D"),
        (lambda: torch.randn(1, 2, 3, 32, 32), "4-D"),
        (lambda: torch.randn(1, 1, 32, 32), "3 channels"),
        (lambda: torch.randn(0, 3, 32, 32), ">= 1"),
        (lambda: torch.randn(1, 3, 0, 8), ">= 1"),
        (lambda: torch.randn(1, 3, 8, 0), ">= 1"),
        (lambda: torch.zeros(1, 3, 32, 32, dtype=torch.int64), "floating-point"),
        (lambda: torch.zeros(1, 3, 32, 32, dtype=torch.uint8), "floating-point"),
        (lambda: torch.zeros(1, 3, 32, 32, dtype=torch.bool), "floating-point"),
        (lambda: torch.randn(1, 3, 32, 32, dtype=torch.float16), "dtype"),
        (lambda: torch.randn(1, 3, 32, 32, device="meta"), "device"),
        (lambda: None, "torch.Tensor"),
    ],
    ids=["3d", "5d", "channels", "empty-batch", "zero-height", "zero-width", "int64", "uint8", "bool",
         "fp16-into-fp32-model", "other-device", "none"],
)
def test_bad_inputs_raise_value_error(model, make, match):
    with pytest.raises(ValueError, match=match):
        model(make())


# ---------------------------------------------------------------- precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_finite_and_close(model, dtype):
    x = torch.randn(2, 3, 59, 83)
    ref = _run(model, x)
    try:
        with torch.autocast("cpu", dtype=dtype):
            outs = _run(model, x)
    except RuntimeError as err:  # pragma: no cover - CPU without these kernels
        pytest.skip(f"{dtype} autocast unsupported here: {err}")
    for o, r in zip(outs, ref):
        assert torch.isfinite(o).all()
        assert (o.float() - r).abs().mean() < 0.1 * r.abs().mean()


def test_masks_do_not_overflow_in_half_precision():
    for dtype in (torch.float16, torch.bfloat16):
        layout = L.get_window_layout(10, 13, 7, 3, True, torch.device("cpu"), dtype)
        assert layout.mask.dtype == dtype and torch.isfinite(layout.mask).all()


# ---------------------------------------------------------------- determinism and caches
def test_same_seed_same_output_and_no_hidden_state():
    def build():
        torch.manual_seed(123)
        m = SwinBackbone(**small_arch())
        m.init_weights()
        return m.eval()

    a, b = build(), build()
    x1, x2 = torch.randn(1, 3, 40, 52), torch.randn(2, 3, 77, 31)
    first = _run(a, x1)
    _run(a, x2)  # another size in between must not change anything
    again = _run(a, x1)
    other = _run(b, x1)
    for f, g, o in zip(first, again, other):
        assert torch.equal(f, g) and torch.equal(f, o)


def test_cache_is_keyed_by_size_and_dtype(model):
    x_a, x_b = torch.randn(1, 3, 44, 60), torch.randn(1, 3, 60, 44)
    ref_a, ref_b = _run(model, x_a), _run(model, x_b)
    for _ in range(2):  # interleave sizes
        for x, ref in ((x_a, ref_a), (x_b, ref_b)):
            for o, r in zip(_run(model, x), ref):
                assert torch.equal(o, r)
    half = SwinBackbone(**small_arch()).eval()
    half.load_state_dict(model.state_dict())
    half.to(torch.bfloat16)
    outs = _run(half, x_a.bfloat16())  # masks for bf16 are built in bf16, not reused fp32 ones
    assert all(o.dtype == torch.bfloat16 for o in outs)
    half.float()
    for o, r in zip(_run(half, x_a), ref_a):
        torch.testing.assert_close(o, r, rtol=5e-2, atol=5e-2)  # bf16-rounded weights, fp32 again


def test_inference_mode_then_training_at_the_same_size():
    # Layouts cached during an inference_mode forward must still work in a training step.
    L.clear_caches()
    model = SwinBackbone(**small_arch())
    model.init_weights()
    x = torch.randn(1, 3, 52, 68)
    with torch.inference_mode():
        model.eval()(x)
    outs = model.train()(x)
    sum(o.mean() for o in outs).backward()
    assert model.stages[0].blocks[1].attn.relative_position_bias_table.grad is not None


# ---------------------------------------------------------------- compile and export
@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.torch_feature("compile_one_graph")
def test_torch_compile_dynamic_matches_eager_without_recompiles(train):
    # One graph serves three sizes (no recompile per size), in eval and in training, where
    # the gradients match eager too. The backend runs dynamo's graph as captured (inductor's
    # C++ compile takes minutes on 2 cores; its numerics are torch's business).
    import torch._dynamo

    torch._dynamo.reset()
    model = SwinBackbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), out_indices=(0, 1),
                         drop_path_rate=0.0)
    model.init_weights()
    model.train(train)
    params = list(model.parameters())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, dynamic=True, backend=backend)
    for size in [(64, 96), (57, 41), (120, 33)]:
        x = torch.randn(1, 3, *size)
        with torch.set_grad_enabled(train):
            got, expected = compiled(x), model(x)
        for c, e in zip(got, expected):
            torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
        if train:
            grads = torch.autograd.grad(sum(o.square().sum() for o in got), params)
            ref_grads = torch.autograd.grad(sum(o.square().sum() for o in expected), params)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 3 sizes"


@pytest.mark.torch_feature("export")
def test_torch_export_dynamic_hw_matches_eager_at_other_sizes():
    from torch.export import Dim, export

    model = SwinBackbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), out_indices=(0, 1)).eval()
    model.init_weights()
    # min 32: smaller sizes give 1-token maps, which torch specialises (0/1 specialisation)
    height, width = Dim("height", min=32, max=1024), Dim("width", min=32, max=1024)
    program = export(model, (torch.randn(1, 3, 64, 96),), dynamic_shapes={"x": {2: height, 3: width}})
    exported = program.module()
    for size in [(64, 96), (57, 41), (120, 33)]:
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            for a, b in zip(exported(x), model(x)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)



@pytest.mark.torch_feature("onnx_dynamo")
def test_onnx_export_dynamic_hw_matches_eager_in_onnxruntime(tmp_path):
    # torch.onnx (dynamo exporter) with dynamic H and W; onnxruntime runs the file at sizes
    # other than the traced one (needs onnxscript + onnxruntime, installed by `make setup`).
    import onnxruntime

    model = SwinBackbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), out_indices=(0, 1)).eval()
    model.init_weights()
    height, width = torch.export.Dim("height", min=32, max=1024), torch.export.Dim("width", min=32, max=1024)
    path = tmp_path / "swin.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 64, 96),), str(path), dynamo=True,
                      dynamic_shapes={"x": {2: height, 3: width}})
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for size in [(64, 96), (57, 41), (120, 33)]:
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            expected = model(x)
        got = session.run(None, {name: x.numpy()})
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(torch.from_numpy(g), e, rtol=1e-4, atol=1e-4)
