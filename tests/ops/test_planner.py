"""The planner decides how each forward runs, and what it decides is what runs.

The other tests check that every implementation gives the same numbers; these check which
implementation each situation gets: CPU inference and training reach the fused (flash) SDPA
kernel, never the math one; tracing sees plain ops only; frozen stages run as inference; and
whatever is handed to SDPA meets the fused CUDA kernels' conditions (checked on the CPU by
inspecting the calls, with the planner's CUDA alignment turned on).
"""
import pytest
import torch
import torch.nn.functional as F

from swin_backbone import SwinBackbone, ops
from swin_backbone.ops import planner
from swin_backbone.ops import layouts as L, windows as W

from ..conftest import small_arch


def test_decisions_per_situation():
    f32 = torch.float32
    cpu_eval = planner.decide("cpu", f32, False, False, False, False, False)
    assert cpu_eval.attention == "sdpa" and cpu_eval.chunk_bytes > 0 and not cpu_eval.save_memory
    cpu_train = planner.decide("cpu", f32, True, False, False, True, False)
    assert cpu_train.attention == "recompute" and cpu_train.save_memory and cpu_train.chunk_bytes > 0
    assert planner.decide("cpu", f32, True, False, False, True, True).attention == "plain"  # attention dropout
    cuda = planner.decide("cuda", torch.bfloat16, True, False, False, False, False)
    # CUDA: "auto" (each stage's kernel measured: ops.plan_stage) where triton is there, else SDPA.
    assert cuda.attention in ("sdpa", "auto") and cuda.align_masks and cuda.save_memory
    assert cuda.chunk_bytes == 0 and cuda.fixup_share == 0
    traced = planner.decide("cpu", f32, True, True, False, False, False)
    assert traced.attention == "plain" and not traced.save_memory and traced.chunk_bytes == 0
    assert planner.decide("cpu", f32, False, True, False, False, False).attention == "sdpa"
    with ops.override(sdpa=False, chunk_bytes=0):
        off = planner.decide("cpu", f32, False, False, False, False, False)
        assert off.attention == "plain" and off.chunk_bytes == 0
    assert planner.decide("cpu", f32, False, False, False, False, False) == cpu_eval  # restored


def test_plan_follows_autocast_and_grad():
    model = SwinBackbone(**small_arch())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert not ops.plan_forward(x, model, False, False, False).grad
    assert ops.plan_forward(x, model, False, False, False).grad  # parameters require grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops.plan_forward(x, model, False, False, False).mask_dtype == torch.bfloat16


def test_cpu_chunk_bytes_is_derived_from_the_machine():
    size = planner.cpu_chunk_bytes()
    assert 4 * 2**20 <= size <= 16 * 2**20


@pytest.mark.parametrize("frozen", [1, 3])
def test_frozen_stages_run_as_inference(frozen):
    model = SwinBackbone(**small_arch(frozen_stages=frozen)).train()
    x = torch.randn(1, 3, 32, 32)
    plan = ops.plan_forward(x, model, False, False, False)
    assert plan.grad and plan.attention == "recompute"
    for i, stage in enumerate(model.stages):
        stage_plan = plan.for_stage(x, stage)
        assert stage_plan.grad == (i >= frozen)
        assert stage_plan.attention == ("recompute" if i >= frozen else "sdpa")
    assert plan.for_stage(x.requires_grad_(), model.stages[0]).grad  # a gradient flows through


def _sdpa_kernels(model, x, train):
    from torch.profiler import profile

    with torch.set_grad_enabled(train), profile() as prof:
        outs = model(x)
        if train:
            sum(o.sum() for o in outs).backward()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("fixup_share", [0.0, 1.0], ids=["per-window-bias", "masked-fixup"])
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.torch_feature("cpu_flash_sdpa")
def test_cpu_reaches_flash_sdpa_never_math(train, fixup_share):
    # torch silently falls back to its slow math SDPA kernel for some masks (one that requires
    # grad, even under no_grad): inference and training (inside the recompute kernel) must
    # reach the CPU flash kernel, with per-window biases and with the masked-window fixup.
    model = SwinBackbone(**small_arch()).train(train)
    with ops.override(fixup_share=fixup_share):
        names = _sdpa_kernels(model, torch.randn(2, 3, 61, 75), train)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.torch_feature("compile_one_graph")
def test_tracing_sees_only_plain_ops(train):
    # Under torch.compile the planner hands the tracer plain torch ops: none of the
    # hand-written autograd functions, no chunked loops, and one graph for the whole forward.
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = SwinBackbone(**small_arch()).train(train)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.set_grad_enabled(train):
        compiled(torch.randn(1, 3, 61, 75))
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert not any("autograd_function" in t for t in targets), sorted(t for t in targets if "autograd" in t)
    assert any("scaled_dot_product_attention" in t for t in targets) != train  # eval: SDPA; training: plain
    torch._dynamo.reset()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.torch_feature("custom_op")
def test_compiling_on_cuda_keeps_the_fused_kernel(grad, monkeypatch):
    # torch.compile on CUDA: the Triton kernel (as a custom operator) where triton is there;
    # torch.export / ONNX and attention dropout: plain ops as on any device.
    bf16 = torch.bfloat16
    monkeypatch.setattr(planner, "_triton_ready", lambda: True)
    compiled = planner._decide("cuda", bf16, grad, True, False, False, False, "auto", planner.Switches())
    # "auto": each stage uses the kernel measured in eager mode (ops.plan_stage), in the graph.
    assert compiled.attention == "auto" and compiled.tracing and not compiled.save_memory
    plain = "plain" if grad else "sdpa"
    assert planner._decide("cuda", bf16, grad, True, False, True, True, "auto", planner.Switches()).attention == "plain"
    assert planner._decide("cuda", bf16, grad, True, False, False, False, "auto", planner.Switches(triton=False)).attention == plain
    monkeypatch.setattr(planner, "_exporting", lambda: True)
    assert planner._decide("cuda", bf16, grad, True, False, False, False, "auto", planner.Switches()).attention == plain
    monkeypatch.setattr(planner, "_exporting", lambda: False)
    monkeypatch.setattr(planner, "_triton_ready", lambda: False)
    assert planner._decide("cuda", bf16, grad, True, False, False, False, "auto", planner.Switches()).attention == plain


def test_kernel_choice_falls_back_where_the_kernel_does_not_apply():
    # Layouts the kernel does not take (here: a 12 x 12 window) get what the same situation
    # gets without the kernel: SDPA, or while tracing a training graph, plain ops.
    x = torch.zeros(1, 24, 24, 64)
    for tracing, grad, expected in ((False, True, "sdpa"), (True, False, "sdpa"), (True, True, "plain")):
        plan = ops.plan_for(x, grad=grad, attention="triton", tracing=tracing)
        assert ops.plan_stage(plan, 24, 24, 12, 6, True, 2, 64, x.device, None)[0].attention == expected


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("train", [False, True])
def test_sdpa_calls_meet_the_fused_cuda_kernels_conditions(train, autocast, monkeypatch):
    # The CUDA memory-efficient kernel needs q/k/v and the mask with last-dim stride 1, the
    # mask in q's dtype, and the mask's other strides multiples of 8 (else torch copies it on
    # every call). With the planner's CUDA alignment on, every SDPA call must meet that, and
    # the number of calls must not grow with the batch (no Python loop over images).
    calls = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        calls.append((q, k, v, attn_mask))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = SwinBackbone(**small_arch()).train(train)
    counts = []
    for batch in (1, 3):
        calls.clear()
        with ops.override(align_masks=True), torch.set_grad_enabled(train):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(torch.randn(batch, 3, 61, 75))
        counts.append(len(calls))
        assert calls
        for q, k, v, mask in calls:
            assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            assert mask is not None and mask.dtype == q.dtype
            assert mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1]), mask.stride()
        if autocast:
            assert {q.dtype for q, *_ in calls} == {torch.bfloat16}
    assert counts[0] == counts[1]
    # The masks were built once in the compute dtype (bf16 under autocast) and cached.
    dtype = torch.bfloat16 if autocast else torch.float32
    before = L.get_window_layout.cache_info()
    layout = L.get_window_layout(16, 19, 7, 3, True, torch.device("cpu"), dtype, True)  # stage 1 of 61x75
    assert L.get_window_layout.cache_info().misses == before.misses
    assert layout.mask.dtype == dtype


def test_rocm_gets_sdpa_in_auto(monkeypatch):
    # The fused kernel is verified on NVIDIA GPUs; an AMD GPU (torch.version.hip) runs SDPA
    # unless the user forces attention='triton'.
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert planner._decide("cuda", torch.bfloat16, True, False, False, False, False, "auto",
                           planner.Switches()).attention == "sdpa"
    assert planner._decide("cuda", torch.bfloat16, True, False, False, False, False, "triton",
                           planner.Switches()).attention == "triton"
