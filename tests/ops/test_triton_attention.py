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
import dataclasses
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
from swin_backbone.ops.attention import run_kernel  # noqa: E402
from swin_backbone.ops.triton_attention import (  # noqa: E402
    triton_window_attention,
    unsupported_reason,
)
from swin_backbone.ops.layouts import build_window_layout, window_partition  # noqa: E402
from swin_backbone.ops.windows import relative_position_index  # noqa: E402

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
    """Partition, attend with bias + region mask (``kernel="plain"``), reverse: float64."""
    qkv, table = qkv.double(), table.double()
    layout = build_window_layout(height, width, window, shift, True, qkv.device, qkv.dtype)
    n = window * window
    bias = table[relative_position_index(window, table_window, qkv.device)].view(n, n, num_heads).permute(2, 0, 1)
    return run_kernel(window_partition(qkv, layout), bias, layout, num_heads, scale, 0.0, "plain")


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
    spec = importlib.util.spec_from_file_location("swin_backbone.ops._triton_attention_without_triton", triton_attention.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    assert module.triton is None
    qkv = torch.zeros(1, 49, 3 * 64)
    assert module.unsupported_reason(qkv, 7, 2) == "triton is not installed"


#: Compiles the kernel for NVIDIA GPUs without one (Triton's code generator, the TTGIR passes
#: and ptxas all run on the host): catches what the interpreter does not check, like types
#: carried through the window loop or invalid dot shapes. Runs in its own process because a
#: process whose triton.language was imported in interpreter mode cannot compile.
COMPILE_CHECK = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from swin_backbone.ops import triton_attention as ta

fn = JITFunction(ta._window_attention_kernel)
for arch, dtype, backward in [(90, "fp16", False), (90, "fp16", True), (80, "fp32", True)]:
    signature = {}
    for name in fn.arg_names:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in ("table_ptr", "dbias_ptr") else "*" + dtype
        else:
            signature[name] = "fp32" if "scale" in name else "i32"
    constexprs = dict(BLOCK_N=64, BLOCK_D=32, INPUT_PRECISION="ieee", BACKWARD=backward, BIAS_GRAD=backward)
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=8, num_stages=2),
    )
    assert kernel.asm["cubin"], (arch, dtype, backward)
print("compiled")
"""


def test_kernel_compiles_for_nvidia_gpus():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_CHECK],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and "compiled" in run.stdout, (run.stdout + run.stderr)[-6000:]


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
        stage_plan = ops.plan_stage(plan, x.shape[1], x.shape[2], 4, 2, True, 2, 16, x.device, None)[0]
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
        stage_plan, *layouts = ops.plan_stage(plan, 6, 7, 4, 2, True, 2, 16, x.device, None)
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


def test_size_arguments_are_not_specialized(no_interpreter):
    # Triton compiles a kernel per value class of a specialized integer (== 1, multiple of
    # 16): every argument that varies with the input size is exempt, so new sizes reuse it.
    kernel = triton_attention._kernel()
    exempt = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    sizes = {"height", "width", "padded_h", "padded_w", "shift", "windows_per_image", "windows_per_row",
             "total_windows", "windows_per_program"}
    assert sizes <= exempt, sorted(sizes - exempt)
    assert not exempt & {"num_heads", "head_dim", "seq_len", "window"}  # fixed per model: keep the hints


# ------------------------------------------------------------------------------ measured choice
# The kernel choice of ops.kernel_choice with the real candidates: the fused kernel (here in
# the interpreter, fp32), SDPA and the float32 reference, on a stage's own inputs.


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    from swin_backbone.ops import kernel_choice

    monkeypatch.setenv("SWIN_BACKBONE_CACHE", str(tmp_path))
    kernel_choice.forget(persisted=False)
    yield kernel_choice
    kernel_choice.forget(persisted=False)


@pytest.fixture
def kernel_wins(monkeypatch):
    """Timings that tie, so the fused kernel (the first candidate) is chosen when it verifies
    (in the interpreter it is far slower than SDPA)."""
    from swin_backbone.ops import stage as stage_ops

    monkeypatch.setattr(stage_ops, "_timer", lambda device: lambda fn: 1.0)


def _auto_plan(x, **fields):
    from swin_backbone import ops

    return ops.plan_for(x, grad=True, attention="auto", save_memory=False, chunk_bytes=0, **fields)


def _plain_results(stage, x):
    from swin_backbone import ops

    plan = ops.plan_for(x, grad=True, attention="plain", save_memory=False, chunk_bytes=0)
    return _values_and_grads(stage, lambda t: stage(t, plan), x)


def _assert_same(results, reference):
    for a, b in zip(results, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_auto_verifies_and_times_the_real_kernels(interpreter, fresh_choices):
    stage = _stage_with_tables()
    x = torch.randn(1, 6, 7, 16)
    _assert_same(_values_and_grads(stage, lambda t: stage(t, _auto_plan(x)), x), _plain_results(stage, x))
    (sig, choice), = fresh_choices.DECISIONS.choices.items()
    assert (sig.window, sig.num_heads, sig.head_dim, sig.training, sig.dtype) == (4, 2, 8, True, "float32")
    assert choice.source == "measured" and not choice.rejected
    assert set(choice.times_ms) == {"sdpa", "triton/warps4"}
    assert all(err < 1e-5 for err in choice.errors.values()), choice.errors


@pytest.mark.parametrize("fault", ["launch raises", "wrong values", "wrong gradients"])
def test_auto_rejects_a_failing_kernel_and_runs_sdpa(interpreter, fresh_choices, monkeypatch, fault):
    if fault == "launch raises":
        def broken(*args, **kwargs):
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
        monkeypatch.setattr(triton_attention, "_launch", broken)
    elif fault == "wrong values":
        real = triton_attention._forward
        monkeypatch.setattr(triton_attention, "_forward", lambda *a: real(*a) * 1.01)
    else:
        real_backward = triton_attention._backward

        def off(*args):
            grad_qkv, grad_table = real_backward(*args)
            return grad_qkv.flip(1), grad_table  # dq, dk, dv at the wrong tokens
        monkeypatch.setattr(triton_attention, "_backward", off)
    stage = _stage_with_tables()
    x = torch.randn(1, 6, 7, 16)
    _assert_same(_values_and_grads(stage, lambda t: stage(t, _auto_plan(x)), x), _plain_results(stage, x))
    (choice,) = fresh_choices.DECISIONS.choices.values()
    expected = {"launch raises": "out of resource", "wrong values": "output off by",
                "wrong gradients": "grad qkv off by"}[fault]
    assert choice.kernel == "sdpa" and expected in choice.rejected["triton/warps4"], choice.rejected


def test_a_later_launch_failure_falls_back_in_forward_and_backward(interpreter, fresh_choices, kernel_wins,
                                                                  monkeypatch):
    stage = _stage_with_tables()
    x = torch.randn(1, 6, 7, 16)
    stage(x.clone().requires_grad_(), _auto_plan(x))  # decided: the kernel
    (sig, choice), = fresh_choices.DECISIONS.choices.items()
    assert choice.kernel == "triton"
    real_backward = triton_attention._backward
    monkeypatch.setattr(triton_attention, "_backward", lambda *a: (_ for _ in ()).throw(RuntimeError("no ptxas")))
    _assert_same(_values_and_grads(stage, lambda t: stage(t, _auto_plan(x)), x), _plain_results(stage, x))
    assert fresh_choices.known(sig).kernel == "sdpa" and fresh_choices.known(sig).source == "fallback"
    monkeypatch.setattr(triton_attention, "_backward", real_backward)
    fresh_choices.forget(persisted=True)
    stage(x.clone().requires_grad_(), _auto_plan(x))
    assert fresh_choices.known(sig).kernel == "triton"
    monkeypatch.setattr(triton_attention, "_launch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no cc")))
    _assert_same(_values_and_grads(stage, lambda t: stage(t, _auto_plan(x)), x), _plain_results(stage, x))
    assert fresh_choices.known(sig).kernel == "sdpa"


def test_forced_kernel_raises_where_it_cannot_run(interpreter, fresh_choices, monkeypatch):
    from swin_backbone import ops

    stage = _stage_with_tables()
    x = torch.randn(1, 6, 7, 16)
    forced = dataclasses.replace(_auto_plan(x), attention="triton", attention_mode="triton")
    _assert_same(_values_and_grads(stage, lambda t: stage(t, forced), x), _plain_results(stage, x))
    fresh_choices.forget(persisted=False)
    monkeypatch.setattr(triton_attention, "_launch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no cc")))
    with pytest.raises(RuntimeError, match="attention='triton'.*no cc"):
        stage(x, forced)
    assert ops.plan_stage(forced, 24, 24, 12, 6, True, 2, 16, x.device, None)[0].attention == "sdpa"  # window 12


def test_compiled_graphs_use_the_eager_decision_and_never_measure(interpreter, fresh_choices, kernel_wins,
                                                                  monkeypatch):
    import torch._dynamo.testing
    from swin_backbone.ops import kernel_choice

    stage = _stage_with_tables()
    probe = torch.zeros(1, 1, 1, 16, requires_grad=True)
    traced = _auto_plan(probe, tracing=True)

    def compiled_targets():
        torch._dynamo.reset()
        recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
        compiled = torch.compile(lambda t: stage(t, traced), backend=recorder, dynamic=True, fullgraph=True)
        out = compiled(torch.randn(2, 6, 7, 16, requires_grad=True))
        out.sum().backward()
        return {str(n.target) for g in recorder.fw_graphs for n in g.graph.nodes if n.op == "call_function"}

    real_decide = kernel_choice.decide
    monkeypatch.setattr(kernel_choice, "decide", lambda *a, **k: pytest.fail("measured while tracing"))
    before = compiled_targets()  # no decision yet: plain attention in a training graph
    assert not any("swin_backbone" in t for t in before) and any("softmax" in t for t in before), sorted(before)
    monkeypatch.setattr(kernel_choice, "decide", real_decide)
    stage(torch.randn(1, 6, 7, 16, requires_grad=True), _auto_plan(probe))  # one eager forward decides
    assert next(iter(fresh_choices.DECISIONS.choices.values())).kernel == "triton"
    monkeypatch.setattr(kernel_choice, "decide", lambda *a, **k: pytest.fail("measured while tracing"))
    after = compiled_targets()
    assert "swin_backbone.window_attention.default" in after, sorted(after)
    torch._dynamo.reset()


def test_gpu_report_rows_verify_every_candidate(interpreter, fresh_choices):
    # The report's attention rows (swin-benchmark --device cuda --report) at a tiny shape: the
    # fused kernel and SDPA each verified (fp32 and fp16, eval and training) and timed.
    from swin_backbone.tools import gpu_report

    shape = dict(arch="tiny", stage=0, height=9, width=10, num_heads=2, head_dim=8)
    rows = gpu_report.kernel_rows(torch.device("cpu"), [shape], [torch.float32, torch.float16], batch=1, window=4,
                                  timer=lambda fn: 1.0)
    assert [(r["dtype"], r["mode"]) for r in rows] == [
        ("float32", "eval"), ("float32", "train"), ("float16", "eval"), ("float16", "train")]
    for r in rows:
        assert set(r["errors"]) == {"triton/warps4", "sdpa"} and not r["rejected"], r
        assert max(r["errors"].values()) < (1e-5 if r["dtype"] == "float32" else 5e-3), r
        assert set(r["times_ms"]) == {"triton/warps4", "sdpa"} and r["chosen"] == "triton"
    lines = gpu_report.format_rows(rows)
    assert len(lines) == 4 and "tiny stage 0 1x9x10 w4 2x8 float16  train -> triton/warps4" in lines[3], lines
    assert not fresh_choices.DECISIONS.choices  # the report decides nothing for the process


def test_windows_above_8_and_old_triton_are_declined(interpreter, monkeypatch):
    # 12 x 12 windows need 256-row blocks: more shared memory than any GPU has (the compiler
    # report in docs/performance.md), so the kernel declines them instead of failing to launch.
    qkv = torch.zeros(1, 144, 3 * 16)
    assert unsupported_reason(qkv, 8, 2) is None
    assert "window 12" in unsupported_reason(qkv, 12, 2)
    monkeypatch.setattr(triton, "__version__", "2.1.0")  # what torch 2.1 brings
    assert unsupported_reason(qkv, 8, 2) == "triton 2.1.0 is older than 3.0"
