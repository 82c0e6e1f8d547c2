"""The fused Triton window attention against the plain PyTorch reference, run on CPU tensors
in the Triton interpreter.

The interpreter only works in a process where ``TRITON_INTERPRET=1`` was set before
``triton.language`` was imported: ``triton.jit`` picks compiled or interpreted mode when it
decorates, and ``triton.language`` decorates its own ``tl.sum`` / ``tl.max`` at import
(an interpreted kernel cannot call compiled-mode ones). So:

* run alone with the flag (``TRITON_INTERPRET=1 python -m pytest tests/ops/test_triton_attention.py``),
  every check runs in this process;
* inside the whole suite (no flag, or triton imported earlier), the kernel checks skip here
  and :func:`test_kernels_in_interpreter_subprocess` runs this file again in a subprocess
  with the flag set, and fails if anything fails there.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", minversion="3.0", reason="triton >= 3.0 is not installed")

from swin_backbone.ops import triton_attention  # noqa: E402
from swin_backbone.ops.triton_attention import (  # noqa: E402
    reference_attention,
    triton_window_attention,
    unsupported_reason,
    verify_once,
)

#: Whether this process can run kernels in the interpreter (see the module docstring).
IN_PROCESS = triton_attention._library_interpreted()


@pytest.fixture
def interpreter():
    """Triton kernels run in the interpreter (on CPU tensors) for the test's duration."""
    if not IN_PROCESS:
        pytest.skip("triton.language was imported without TRITON_INTERPRET=1: "
                    "test_kernels_in_interpreter_subprocess runs this check")
    with triton.knobs.runtime.scope():  # restores the knob and the environment afterwards
        triton.knobs.runtime.interpret = True
        yield


@pytest.fixture
def no_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        yield


def test_kernels_in_interpreter_subprocess():
    if IN_PROCESS:
        pytest.skip("the interpreter works in this process: the checks ran here")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=root,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    summary = tail.strip().splitlines()[-1]
    # Everything ran there; the one skip is this test itself (the interpreter works there).
    assert re.search(r"\d+ passed", summary) and re.search(r"\b1 skipped", summary), tail


def reference(qkv, table, height, width, window, shift, table_window, num_heads, scale):
    """The reference algorithm (ops.attention.reference_window_attention) on the same qkv, in float64."""
    return reference_attention(qkv.double(), table.double(), height, width, window, shift, table_window, num_heads,
                               scale)


def make_inputs(batch, height, width, table_window, num_heads, head_dim, dtype):
    channels = num_heads * head_dim
    qkv = torch.randn(batch, height * width, 3 * channels).to(dtype).requires_grad_()
    # fp32 like a Parameter under autocast, whatever the activations' dtype.
    table = torch.randn((2 * table_window - 1) ** 2, num_heads).requires_grad_()
    return qkv, table


# (batch, height, width, window, shift, table_window, heads, head_dim, windows_per_program)
CASES = {
    # 2 windows per image, no shift, no padding: no masking at all.
    "aligned": (2, 7, 14, 7, 0, 7, 2, 32, None),
    # Padding in H and W (14 x 14 padded map) and a shift: regions 0..8 and padding meet.
    "padded-shifted": (2, 9, 11, 7, 3, 7, 3, 16, None),
    # The same 8 windows in groups of 3, 3 and 2 per program (the last group is partial).
    "grouped": (2, 9, 11, 7, 3, 7, 2, 16, 3),
    # A map smaller than one window: padded up to it, still shifted.
    "smaller-than-window": (1, 3, 5, 7, 3, 7, 2, 32, None),
    # A 3 x 3 window reading the offsets of a table built for 7 x 7 (N = 9 in a 16-row block).
    "window-below-table": (2, 6, 5, 3, 1, 7, 2, 16, None),
    # head_dim 24 is padded to a 32-wide block.
    "head-dim-24": (1, 7, 7, 7, 3, 7, 2, 24, None),
}

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(interpreter, case, dtype):
    batch, height, width, window, shift, tw, heads, head_dim, per_program = CASES[case]
    qkv, table = make_inputs(batch, height, width, tw, heads, head_dim, dtype)
    scale = head_dim**-0.5
    assert unsupported_reason(qkv, window, heads, height=height, width=width) is None

    out = triton_window_attention(
        qkv, table, height, width, window, shift, tw, heads, scale, windows_per_program=per_program
    )
    assert out.shape == (batch, height * width, heads * head_dim) and out.dtype == dtype
    grad_out = torch.randn(out.shape).to(dtype)
    grad_qkv, grad_table = torch.autograd.grad(out, (qkv, table), grad_out)
    assert grad_qkv.dtype == dtype and grad_table.dtype == table.dtype

    expected = reference(qkv, table, height, width, window, shift, tw, heads, scale)
    exp_qkv, exp_table = torch.autograd.grad(expected, (qkv, table), grad_out.double())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(grad_qkv.double(), exp_qkv.double(), atol=tol, rtol=tol)
    torch.testing.assert_close(grad_table.double(), exp_table.double(), atol=tol, rtol=tol)
    # The comparison means something: the bias gradient is not trivially zero.
    assert exp_table.abs().max() > 0.1


def test_masking_is_exercised(interpreter):
    """Shift regions and padding change the result: without the region mask (attention over
    the whole padded window) the output would differ, so the reference comparison above
    does check the mask."""
    batch, height, width, window, shift, tw, heads, head_dim, _ = CASES["padded-shifted"]
    qkv, table = make_inputs(batch, height, width, tw, heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    out = triton_window_attention(qkv, table, height, width, window, shift, tw, heads, scale)
    unshifted = reference(qkv, table, height, width, window, 0, tw, heads, scale)
    assert (out.double() - unshifted).abs().max() > 0.1


def test_table_gradient_finite_differences(interpreter):
    """Central differences of a fixed linear loss in two table entries (fp32 kernel)."""
    batch, height, width, window, shift, tw, heads, head_dim, _ = CASES["padded-shifted"]
    qkv, table = make_inputs(batch, height, width, tw, heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    weights = torch.randn(batch, height * width, heads * head_dim, dtype=torch.float64)

    def loss(tab):
        out = triton_window_attention(qkv.detach(), tab, height, width, window, shift, tw, heads, scale)
        return (out.double() * weights).sum()

    (grad,) = torch.autograd.grad(loss(table), table)
    side = 2 * tw - 1
    center = (tw - 1) * side + (tw - 1)  # offset (0, 0): every token with itself
    off_center = (tw - 1 + 1) * side + (tw - 1 - 2)  # offset (dy, dx) = (1, -2)
    eps = 1e-2
    for row, head in [(center, 0), (off_center, heads - 1)]:
        plus, minus = table.detach().clone(), table.detach().clone()
        plus[row, head] += eps
        minus[row, head] -= eps
        numeric = (loss(plus) - loss(minus)).item() / (2 * eps)
        assert abs(grad[row, head].item()) > 0.05
        assert numeric == pytest.approx(grad[row, head].item(), rel=1e-2, abs=2e-3)


def test_no_grad_and_table_without_grad(interpreter):
    """Only ``qkv`` requires grad: the table gradient is skipped, ``qkv``'s is unchanged."""
    batch, height, width, window, shift, tw, heads, head_dim, _ = CASES["smaller-than-window"]
    qkv, table = make_inputs(batch, height, width, tw, heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    with torch.no_grad():
        plain = triton_window_attention(qkv, table, height, width, window, shift, tw, heads, scale)
    out = triton_window_attention(qkv, table.detach(), height, width, window, shift, tw, heads, scale)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    grad_out = torch.randn(out.shape)
    (grad_qkv,) = torch.autograd.grad(out, (qkv,), grad_out)
    expected = reference(qkv, table, height, width, window, shift, tw, heads, scale)
    (exp_qkv,) = torch.autograd.grad(expected, (qkv,), grad_out.double())
    torch.testing.assert_close(grad_qkv.double(), exp_qkv.double(), atol=1e-5, rtol=1e-5)


def test_supports_interpreter_on(interpreter):
    qkv = torch.zeros(1, 99, 3 * 64)
    assert unsupported_reason(qkv, 7, 2, height=9, width=11) is None
    assert unsupported_reason(qkv.half(), 7, 2) is None
    assert unsupported_reason(qkv, 7, 2) is None
    assert unsupported_reason(qkv.bfloat16(), 7, 2) is not None  # tl.dot in bf16 is wrong in the interpreter
    with pytest.raises(ValueError, match="bfloat16"):
        triton_window_attention(qkv.bfloat16(), torch.zeros(169, 2), 9, 11, 7, 3, 7, 2, 0.25)
    assert unsupported_reason(qkv.double(), 7, 2) is not None
    assert unsupported_reason(qkv, 7, 2, dropout_p=0.1) is not None
    assert unsupported_reason(qkv, 17, 2) is not None  # 289 tokens per window
    assert unsupported_reason(torch.zeros(1, 99, 3 * 256), 7, 1) is not None  # head_dim 256
    assert unsupported_reason(torch.zeros(1, 99, 3 * 64), 7, 1) is not None  # head_dim 64
    assert unsupported_reason(qkv, 7, 5) is not None  # 64 channels, 5 heads
    # mask_padding=False: fine without padding, not with it (or when it cannot be ruled out).
    assert unsupported_reason(torch.zeros(1, 98, 192), 7, 2, height=7, width=14, mask_padding=False) is None
    assert unsupported_reason(qkv, 7, 2, height=9, width=11, mask_padding=False) is not None
    assert unsupported_reason(qkv, 7, 2, mask_padding=False) is not None


def test_supports_interpreter_off(no_interpreter):
    qkv = torch.zeros(1, 49, 3 * 64)
    assert unsupported_reason(qkv, 7, 2) is not None
    assert "TRITON_INTERPRET" in unsupported_reason(qkv, 7, 2)
    with pytest.raises(ValueError, match="cannot run here"):
        triton_window_attention(qkv, torch.zeros(169, 2), 7, 7, 7, 0, 7, 2, 0.25)


def test_bad_arguments():
    qkv = torch.zeros(2, 99, 3 * 64)
    table = torch.zeros(169, 2)
    args = dict(height=9, width=11, window=7, shift=3, table_window=7, num_heads=2, scale=0.25)

    def call(qkv=qkv, table=table, **kw):
        return triton_window_attention(qkv, table, **{**args, **kw})

    with pytest.raises(ValueError, match="height \\* width"):
        call(height=10)
    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=torch.zeros(99, 3 * 64))
    with pytest.raises(ValueError, match="num_heads=5"):
        call(num_heads=5, table=torch.zeros(169, 5))
    with pytest.raises(ValueError, match="window must be"):
        call(window=8)  # larger than the table's window
    with pytest.raises(ValueError, match="window must be"):
        call(window=0, shift=0)
    with pytest.raises(ValueError, match="shift must be"):
        call(shift=7)
    with pytest.raises(ValueError, match="shift must be"):
        call(shift=-1)
    with pytest.raises(ValueError, match="table must be"):
        call(table=torch.zeros(169, 3))
    with pytest.raises(ValueError, match="height and width"):
        call(height=0, qkv=torch.zeros(2, 0, 3 * 64))


def test_imports_and_declines_without_triton(monkeypatch):
    """The module loads where triton is missing, launches nothing, and says why it declines."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    name = "swin_backbone.ops._triton_attention_without_triton"
    spec = importlib.util.spec_from_file_location(name, triton_attention.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    assert module.triton is None
    qkv = torch.zeros(1, 49, 3 * 64)
    assert module.unsupported_reason(qkv, 7, 2) == "triton is not installed"


def _stage_with_tables(seed=0):
    """A one-stage Swin with non-trivial bias tables (window 4, 2 heads of 8 channels)."""
    from swin_backbone import SwinBackbone

    torch.manual_seed(seed)
    model = SwinBackbone(arch=None, embed_dims=16, depths=(2,), num_heads=(2,), window_size=4, drop_path_rate=0.0,
                         out_indices=(0,))
    with torch.no_grad():
        for table in (b.attn.relative_position_bias_table for b in model.stages[0].blocks):
            table.normal_(0, 0.5)
    return model.stages[0]


def _values_and_grads(stage, run, x, weight=1.0):
    """``out = run(x) * weight`` and the gradients of ``sum(out ** 2)`` for ``x`` and the
    second block's bias table (the first block has no shift)."""
    stage.zero_grad()
    xi = x.clone().requires_grad_(True)
    out = run(xi) * weight
    out.square().sum().backward()
    return out.detach(), xi.grad, stage.blocks[1].attn.relative_position_bias_table.grad.clone()


@pytest.mark.parametrize("size", [(24, 28), (16, 16)])
def test_planner_routes_a_stage_through_the_kernel(interpreter, size):
    # A plan naming "triton" sends a whole stage (norm -> qkv on row-major tokens -> fused
    # kernel -> projection, shifted and padded maps) through the kernel; its values and
    # gradients equal the plain path's.
    from swin_backbone import ops

    stage = _stage_with_tables()
    x = torch.randn(1, size[0] // 4, size[1] // 4, 16)
    results = []
    for kernel in ("triton", "plain"):
        plan = ops.plan_for(x, grad=True, attention=kernel, save_memory=False, chunk_bytes=0)
        stage_plan = ops.plan_stage(plan,
            height=x.shape[1], width=x.shape[2], window=4, shift=2, table_window=4, mask_padding=True, num_heads=2,
            head_dim=8, device=x.device)[0]
        assert stage_plan.attention == kernel
        results.append(_values_and_grads(stage, lambda t: stage(t, plan), x))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_per_image_windows_go_through_the_kernel(interpreter):
    # A batch with per-image valid sizes (images whose edges cut windows, both layouts): the
    # kernel runs every window with the shared masks, SDPA redoes the cut windows with their
    # own masks; values and gradients equal the plain path's.
    from swin_backbone import ops

    stage = _stage_with_tables()
    x = torch.randn(2, 6, 7, 16)
    valid = ((6, 5), (3, 7))
    # Tokens beyond an image are padding to it (unspecified values, zeroed in the backbone's
    # outputs): the two paths fill window padding differently there, so compare the images.
    inside = ops.image_sizes.valid_token_mask(6, 7, valid, x.device)[..., None]
    results = []
    for kernel in ("triton", "plain"):
        plan = ops.plan_for(x, grad=True, attention=kernel, save_memory=False, chunk_bytes=0, valid_sizes=valid)
        stage_plan, *layouts = ops.plan_stage(plan,
            height=6, width=7, window=4, shift=2, table_window=4, mask_padding=True, num_heads=2, head_dim=8,
            device=x.device)
        assert stage_plan.attention == kernel
        for layout in layouts:
            assert layout.images is not None
        results.append(_values_and_grads(stage, lambda t: stage(t, plan), x, inside))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_stage_runs_the_kernel_as_one_operator(interpreter, backend):
    # Under torch.compile the plan's "triton" puts the kernel into the graph as the custom
    # operators swin_backbone::window_attention (+ _backward): no attention ops of torch's
    # own in either graph, one graph for maps of 3 sizes (dynamic shapes, padded and shifted
    # windows), and values and gradients equal to the eager plain path's.
    import torch._dynamo.testing
    from swin_backbone import ops

    stage = _stage_with_tables()
    probe = torch.zeros(1, 1, 1, 16, requires_grad=True)
    compiled_plan = ops.plan_for(probe, grad=True, attention="triton", save_memory=False, chunk_bytes=0, tracing=True)
    eager_plan = ops.plan_for(probe, grad=True, attention="plain", save_memory=False, chunk_bytes=0)
    torch._dynamo.reset()
    if backend == "aot_eager":
        recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
        counter = torch._dynamo.testing.CompileCounterWithBackend(recorder)
    else:
        recorder, counter = None, torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda x: stage(x, compiled_plan), backend=counter, dynamic=True, fullgraph=True)
    sizes = [(6, 7), (9, 10), (5, 9)] if backend == "aot_eager" else [(6, 7), (5, 9)]
    frames = []
    for size in sizes:
        x = torch.randn(2, *size, 16)
        results = [_values_and_grads(stage, run, x) for run in (compiled, lambda t: stage(t, eager_plan))]
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and len(set(frames)) == 1, f"recompiled for another size: frames compiled {frames}"
    if recorder is not None:
        def targets(graphs):
            return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}

        forward, backward = targets(recorder.fw_graphs), targets(recorder.bw_graphs)
        assert "swin_backbone.window_attention.default" in forward, sorted(forward)
        assert "swin_backbone.window_attention_backward.default" in backward, sorted(backward)
        assert not any(op in t for t in forward | backward for op in ("softmax", "bmm", "scaled_dot_product"))
    torch._dynamo.reset()


def test_exported_programs_never_hold_the_kernel(interpreter, monkeypatch):
    # torch.export on a CUDA plan would otherwise record the custom operator: exported
    # programs must stay plain torch (ONNX, other runtimes). The planner is asked as on CUDA.
    from swin_backbone import SwinBackbone
    from swin_backbone.ops import planner

    real = planner._decide

    def as_on_cuda(device, *args):
        return real("cuda", *args)

    monkeypatch.setattr(planner, "_decide", as_on_cuda)
    model = SwinBackbone(arch=None, embed_dims=16, depths=(2,), num_heads=(2,), window_size=4,
                         drop_path_rate=0.0, out_indices=(0,)).eval()
    program = torch.export.export(model, (torch.randn(1, 3, 24, 28),))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("swin_backbone" in t for t in targets), sorted(targets)


def test_fp32_precision_follows_either_tf32_api():
    # torch >= 2.9 programs may set matmul precision through fp32_precision; reading the
    # legacy allow_tf32 then raises, so the kernel reads whichever API torch has.
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has only allow_tf32")
    cuda = torch.device("cuda")
    old = matmul.fp32_precision
    try:
        for setting, expected in (("tf32", "tf32"), ("ieee", "ieee")):
            matmul.fp32_precision = setting
            assert triton_attention._input_precision(torch.float32, cuda) == expected
            assert triton_attention._input_precision(torch.float16, cuda) == "ieee"
    finally:
        matmul.fp32_precision = old


def test_integer_arguments_are_not_specialized(no_interpreter):
    # Triton compiles a kernel per value class of a specialized integer (== 1, multiple of
    # 16): every integer argument is exempt, so that each dtype has one compiled variant (the
    # one the compile test builds and verify_once runs), whatever the sizes and the model.
    kernel = triton_attention._kernel()
    exempt = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    integers = {n for n in kernel.arg_names if not n.isupper() and not n.endswith("_ptr") and "scale" not in n}
    assert integers == set(triton_attention.INTEGER_ARGUMENTS) and integers <= exempt, sorted(integers - exempt)


# ------------------------------------------------------------------------------ verify_once
# The check at first use, with the real kernel (here in the interpreter) and the reference.


@pytest.fixture
def fresh_checks():
    """verify_once's in-process record, emptied before and after the test."""
    triton_attention._VERIFIED.clear()
    yield triton_attention._VERIFIED
    triton_attention._VERIFIED.clear()


def test_verify_once_passes_once_and_remembers(interpreter, fresh_checks, monkeypatch):
    cpu = torch.device("cpu")
    state = torch.get_rng_state()
    verify_once(cpu, torch.float32)
    verify_once(cpu, torch.float16)
    assert torch.equal(torch.get_rng_state(), state)  # the user's random stream is untouched
    assert sorted(fresh_checks.values(), key=str) == [None, None] and len(fresh_checks) == 2
    # Later calls return at once: no launch, no reference.
    monkeypatch.setattr(triton_attention, "_launch", lambda *a, **k: pytest.fail("launched again"))
    monkeypatch.setattr(triton_attention, "reference_attention", lambda *a, **k: pytest.fail("checked again"))
    for _ in range(3):
        verify_once(cpu, torch.float32)


@pytest.mark.parametrize("wrong", ["qk_scale", "scale"], ids=["forward-scale", "backward-scale"])
def test_verify_once_names_what_a_broken_kernel_got_wrong(interpreter, fresh_checks, monkeypatch, wrong):
    # A deliberately wrong kernel argument: the forward's log2-scaled query scale, or the
    # scale only the backward reads (dq, dk): the check sees the output, or the gradients.
    real_plan = triton_attention._plan
    position = -2 if wrong == "qk_scale" else -1

    def off_by_a_quarter(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        sizes = list(plan.sizes)
        sizes[position] *= 1.25
        return triton_attention._Plan(tuple(sizes), plan.num_heads, plan.groups, plan.window, plan.channels)

    monkeypatch.setattr(triton_attention, "_plan", off_by_a_quarter)
    expected = "output off by" if wrong == "qk_scale" else "grad qkv off by"
    message = r"attention='triton': the fused Triton kernel failed its check against the reference on cpu .*fp32: "
    with pytest.raises(RuntimeError, match=message + expected):
        verify_once(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(triton_attention, "_plan", real_plan)
    with pytest.raises(RuntimeError, match=expected):  # remembered, not checked again
        verify_once(torch.device("cpu"), torch.float32)


def test_verify_once_names_an_exception(interpreter, fresh_checks, monkeypatch):
    # A launch that raises (as a compiler or driver error would): its text is the reason.
    def shared_memory(plan, *args):
        raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    monkeypatch.setattr(triton_attention, "_launch", shared_memory)
    with pytest.raises(RuntimeError, match="float16|fp16: RuntimeError: out of resource: shared memory"):
        verify_once(torch.device("cpu"), torch.float16)
    # Where the kernel cannot run at all, the check says why.
    with pytest.raises(RuntimeError, match="bf16: it cannot run here: bfloat16 tl.dot"):
        verify_once(torch.device("cpu"), torch.bfloat16)


# ------------------------------------------------------------------------------ the static gate


def test_capability_gate_is_the_compile_matrix():
    # The GPUs the kernel runs on are exactly the targets tests/ops/test_triton_compile.py
    # builds cleanly; everything else is named and declined.
    for major, minor in ((8, 0), (8, 6), (8, 9), (9, 0)):
        assert major * 10 + minor in triton_attention.COMPILE_TARGETS
        assert triton_attention.capability_reason("GPU", major, minor) is None
    for name, major, minor in (("Tesla V100-SXM2-16GB", 7, 0), ("Tesla T4", 7, 5), ("Jetson AGX Orin", 8, 7),
                               ("NVIDIA B200", 10, 0), ("NVIDIA GeForce RTX 5090", 12, 0)):
        reason = triton_attention.capability_reason(name, major, minor)
        assert reason == (f"{name} (compute capability {major}.{minor}): the kernel is compile-checked for sm_80, "
                          "sm_86, sm_89, sm_90 only (tests/ops/test_triton_compile.py)"), reason


def test_triton_version_gate():
    listed = ", ".join(f"{major}.{minor}" for major, minor in triton_attention.TRITON_VERSIONS)
    for major, minor in triton_attention.TRITON_VERSIONS:
        assert triton_attention.triton_version_reason(f"{major}.{minor}.0") is None
        assert triton_attention.triton_version_reason(f"{major}.{minor}.1+git1234") is None
    newest = max(triton_attention.TRITON_VERSIONS)
    # torch 2.1 and 2.3's; 3.3 and 3.4 (torch 2.7, 2.8) spill in the sm_90 TF32 backward; the next one
    for version in ("2.1.0", "2.3.1", "3.3.1", "3.4.0", f"{newest[0]}.{newest[1] + 1}.0"):
        assert triton_attention.triton_version_reason(version) == (
            f"triton {version}: the kernel's compile matrix is clean with triton {listed} only "
            "(tests/ops/test_triton_compile.py)")


def test_gpu_report_rows_verify_and_time_both_kernels(interpreter, fresh_checks):
    # The report's rows (swin-benchmark --device cuda --report) at a tiny shape on CPU tensors:
    # the fused kernel (interpreter) and SDPA each compared with the reference and timed.
    from swin_backbone.tools import gpu_report

    shape = dict(arch="tiny", stage=0, height=9, width=10, num_heads=2, head_dim=8)
    rows = gpu_report.kernel_rows(torch.device("cpu"), [shape], [torch.float32, torch.float16], batch=1, window=4,
                                  repeat=1)
    assert [(r["dtype"], r["mode"]) for r in rows] == [
        ("fp32", "eval"), ("fp32", "train"), ("fp16", "eval"), ("fp16", "train")]
    for r in rows:
        assert set(r["errors"]) == {"triton", "sdpa"} and not r["rejected"], r
        assert max(r["errors"].values()) < (1e-5 if r["dtype"] == "fp32" else 5e-3), r
        assert set(r["times_ms"]) == {"triton", "sdpa"} and all(t > 0 for t in r["times_ms"].values()), r
    lines = gpu_report.format_rows(rows)
    assert len(lines) == 2 + 4 and lines[0].startswith("| arch | stage |"), lines
    assert lines[-1].startswith("| tiny | 0 | 1x9x10 | w4 | 2x8 | fp16 | train |"), lines


def test_windows_above_8_and_heads_above_32_are_declined(interpreter):
    # The one launch shape holds a 64-token window and a 32-channel head (larger blocks spill
    # kilobytes per thread: docs/gpu-kernel.md), so the kernel declines the rest up front.
    qkv = torch.zeros(1, 144, 3 * 16)
    assert unsupported_reason(qkv, 8, 2) is None
    assert "window 12" in unsupported_reason(qkv, 12, 2)
    assert "head_dim 64" in unsupported_reason(torch.zeros(1, 144, 3 * 128), 8, 2)
