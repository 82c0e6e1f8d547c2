"""The planner decides how each forward runs, and what it decides is what runs.

The other tests check that every implementation gives the same numbers; these check which
implementation each situation gets: CPU inference and training reach the fused (flash) SDPA
kernel, never the math one; tracing sees plain ops only; frozen stages run as inference; and
whatever is handed to SDPA meets the fused CUDA kernels' conditions (checked on the CPU by
inspecting the calls, with the planner's CUDA alignment turned on).
"""
import dataclasses
import pytest
import torch
import torch.nn.functional as F

from swin_backbone import SwinBackbone, ops
from swin_backbone.ops import planner
from swin_backbone.ops import layouts as L, windows as W

from swin_backbone.ops import DropPath

from ..helpers import small_arch


def decide(device, dtype, grad, traced, stochastic, attn_dropout):
    """The planner's decision for a situation, with exact modules and the switches in force
    (``dtype``: the situation's compute dtype, which the plan does not depend on)."""
    return planner._decide_cached(device, grad, traced, stochastic, attn_dropout, True, planner._SWITCHES)


def _aligned(device):
    """Whether a stage's layouts on ``device`` get 8-aligned mask rows."""
    regular, _ = ops.stage_layouts(torch.zeros(1, 9, 9, 8, device=device), ops.plan_for(torch.zeros(1)),
                                   window_size=7, shift_size=3, pad_small_map=True, mask_padding=True)
    return regular.align


def test_decisions_per_situation():
    f32 = torch.float32
    cpu_eval = decide("cpu", f32, False, False, False, False)
    assert cpu_eval.attention == "sdpa" and cpu_eval.chunk_bytes > 0 and not cpu_eval.save_memory
    cpu_train = decide("cpu", f32, True, False, True, False)
    assert cpu_train.attention == "recompute" and cpu_train.save_memory and cpu_train.chunk_bytes > 0
    assert not _aligned("cpu")
    with ops.override(align_masks=True):
        assert _aligned("cpu")
    assert decide("cpu", f32, True, False, True, True).attention == "matmul"  # attention dropout
    # CUDA: 'auto' is memory-efficient SDPA (no measurement), in training and inference.
    cuda = decide("cuda", torch.bfloat16, True, False, False, False)
    assert cuda.attention == "sdpa"
    # Lean saves (no norm / GELU output kept) only where measured (CPU): off on CUDA unless asked for.
    assert not cuda.save_memory
    with planner.override(save_memory=True):
        assert decide("cuda", torch.bfloat16, True, False, False, False).save_memory
    assert cuda.chunk_bytes == 0 and not cuda.traceable
    assert decide("cuda", torch.bfloat16, False, False, False, False).attention == "sdpa"
    traced = decide("cpu", f32, True, True, False, False)
    assert traced.attention == "matmul" and not traced.save_memory and traced.chunk_bytes == 0 and traced.traceable
    assert decide("cpu", f32, False, True, False, False).attention == "sdpa"
    # Traced training on CUDA: SDPA (memory-efficient / cuDNN kernels give the bias its gradient).
    assert decide("cuda", f32, True, True, False, False).attention == "sdpa"
    assert decide("cuda", f32, False, True, False, False).attention == "sdpa"
    with ops.override(sdpa=False, chunk_bytes=0):
        off = decide("cpu", f32, False, False, False, False)
        assert off.attention == "matmul" and off.chunk_bytes == 0
    with ops.override(recompute_attention=False, save_memory=False):
        off = decide("cpu", f32, True, False, True, False)
        assert off.attention == "matmul" and not off.save_memory
    assert decide("cpu", f32, False, False, False, False) == cpu_eval  # restored
    # With hooks or replaced modules too (lean saves call no module again): not while tracing.
    hooked = planner._decide_cached("cpu", True, False, True, False, False, planner._SWITCHES)
    assert hooked.save_memory and not hooked.exact_modules
    assert not planner._decide_cached("cpu", False, False, True, False, True, planner._SWITCHES).exact_modules  # (dropout)
    assert planner._decide_cached("cpu", False, False, False, False, True, planner._SWITCHES).exact_modules


def test_torchscript_tracing_plans_matmul_attention():
    # torch.jit.trace (and the ONNX exporter / FLOP counters built on it) records a traceable plan
    # with matmul + softmax attention, also in inference; eagerly the same
    # inference runs SDPA.
    model = SwinBackbone(**small_arch())
    seen = []

    def fn(x):
        seen.append(ops.plan_for(x, model))
        assert ops.tracing()
        return x * 2

    with torch.no_grad():
        torch.jit.trace(fn, torch.randn(1, 3, 8, 8), check_trace=False)  # (the check reruns fn eagerly)
        eager = ops.plan_for(torch.randn(1, 3, 8, 8), model)
    assert not ops.tracing()
    assert len(seen) == 1 and seen[0].traceable and seen[0].attention == "matmul"
    assert seen[0].chunk_bytes == 0 and not seen[0].exact_modules and not seen[0].save_memory
    assert not eager.traceable and eager.attention == "sdpa"


def test_a_traced_plan_is_decided_under_its_own_tracer():
    # A compiled backbone plans its blocks eagerly as traced ones (SDPA: dynamo compiles it), and
    # those plans are cached; a module TorchScript traces afterwards still gets matmuls, not
    # that cached plan (the tracer is part of the answer, not of the cache key).
    model = SwinBackbone(**small_arch()).eval()
    block, seen = model.stages[0].blocks[0], []

    def fn(x):
        seen.append(ops.plan_for(x, block))
        return x * 2

    with torch.no_grad():
        compiled = ops.plan_stages(torch.randn(1, 3, 32, 32), model, compiled_blocks=True)
        torch.jit.trace(fn, torch.randn(1, 16, 32), check_trace=False)
        again = ops.plan_stages(torch.randn(1, 3, 32, 32), model, compiled_blocks=True)
    assert compiled[0].traceable and compiled[0].attention == "sdpa" and again == compiled
    assert seen[0].traceable and seen[0].attention == "matmul"


def test_torchscript_trace_of_the_backbone_runs_matmuls():
    # The traced graph holds matmuls and softmax (no SDPA, no Python autograd function) and
    # computes what the eager model computes.
    model = SwinBackbone(arch=None, embed_dims=16, depths=(2, 2), num_heads=(1, 2), out_indices=(0, 1),
                         drop_path_rate=0.0).eval()
    x = torch.randn(1, 3, 45, 61)
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,), check_trace=False)
        kinds = {node.kind() for node in traced.inlined_graph.nodes()}
        assert "aten::softmax" in kinds and "aten::scaled_dot_product_attention" not in kinds, sorted(kinds)
        assert "prim::PythonOp" not in kinds
        for a, b in zip(traced(x), model(x)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_plan_follows_autocast_and_grad():
    model = SwinBackbone(**small_arch())
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert not ops.plan_for(x, model).grad
    assert ops.plan_for(x, model).grad  # parameters require grad
    def mask_dtype() -> torch.dtype:
        regular, _ = ops.stage_layouts(x.new_zeros(1, 9, 9, 8), ops.plan_for(x, model), window_size=7,
                                       shift_size=3, pad_small_map=True, mask_padding=True)
        return regular.mask.dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):  # (the masks are cached in the compute dtype)
        assert mask_dtype() == torch.bfloat16
    assert mask_dtype() == torch.float32


def test_cpu_chunk_bytes_is_derived_from_the_machine():
    size = planner.cpu_chunk_bytes()
    assert 4 * 2**20 <= size <= 16 * 2**20


@pytest.mark.parametrize("frozen", [1, 3])
def test_frozen_stages_run_as_inference(frozen):
    model = SwinBackbone(**small_arch(frozen_stages=frozen)).train()
    x = torch.randn(1, 3, 32, 32)
    plan = ops.plan_for(x, model)
    assert plan.grad and plan.attention == "recompute"
    plans = ops.plan_stages(x, model)
    assert len(plans) == len(model.stages)
    for i, stage_plan in enumerate(plans):
        assert stage_plan.grad == (i >= frozen)
        assert stage_plan.attention == ("recompute" if i >= frozen else "sdpa")
    assert ops.plan_stages(x.requires_grad_(), model)[0].grad  # a gradient flows through


def _sdpa_kernels(model, x, train):
    from torch.profiler import profile

    with torch.set_grad_enabled(train), profile() as prof:
        outs = model(x)
        if train:
            sum(o.sum() for o in outs).backward()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.torch_feature("cpu_flash_sdpa")
def test_cpu_reaches_flash_sdpa_never_math(train):
    # torch silently falls back to its slow math SDPA kernel for some masks (one that requires
    # grad, even under no_grad): inference and training (inside the recompute kernel) must
    # reach the CPU flash kernel with the per-window biases.
    model = SwinBackbone(**small_arch()).train(train)
    names = _sdpa_kernels(model, torch.randn(2, 3, 61, 75), train)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names


@pytest.mark.slow
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
    assert any("scaled_dot_product_attention" in t for t in targets) != train  # eval: SDPA; training: matmul
    torch._dynamo.reset()


@pytest.mark.parametrize("grad", [False, True])
def test_tracing_on_cuda_plans_by_the_situation(grad):
    # torch.compile / torch.export on CUDA: SDPA in inference and in training (CUDA's kernels
    # give the bias its gradient; on the CPU a training graph has plain ops); attention
    # dropout: plain ops.
    bf16, switches = torch.bfloat16, planner.Switches()
    compiled = planner._decide("cuda", grad, True, False, False, False, switches)
    assert compiled.attention == "sdpa" and compiled.traceable and not compiled.save_memory
    assert planner._decide("cpu", grad, True, False, False, False, switches).attention == (
        "matmul" if grad else "sdpa")
    assert planner._decide("cuda", grad, True, True, True, False, switches).attention == "matmul"


def test_checkpointed_stages_skip_lean_saves():
    # A stage that with_cp checkpoints block by block keeps nothing inside them: no lean saves.
    x = torch.randn(1, 3, 32, 32)
    for with_cp in (False, True):
        model = SwinBackbone(**small_arch(with_cp=with_cp)).train()
        assert all(plan.save_memory != with_cp for plan in ops.plan_stages(x, model))


def test_compiled_blocks_layouts_are_cached_and_traced_ones_are_built():
    # compile=True: the planner runs eagerly and hands the compiled blocks traced-form layouts;
    # they are cached like eager ones (built once per size, not on every forward). While
    # torch.jit.trace records, sizes may be symbolic: built each time.
    x = torch.zeros(1, 14, 13, 32)
    plan = dataclasses.replace(ops.plan_for(x), traceable=True)
    kwargs = dict(window_size=7, shift_size=3, pad_small_map=True, mask_padding=True)
    regular, shifted = ops.stage_layouts(x, plan, **kwargs)
    again = ops.stage_layouts(x, plan, **kwargs)
    assert regular.traceable and shifted.traceable and regular.plan is plan
    assert again[0].index is regular.index and again[1].mask is shifted.mask  # (the cached layouts' tensors)
    seen = []

    def fn(t):
        seen.append(ops.stage_layouts(x, plan, **kwargs)[0])
        return t * 2

    torch.jit.trace(fn, torch.randn(2), check_trace=False)
    assert seen[0].traceable and seen[0].index is not regular.index
    assert torch.equal(seen[0].index, regular.index) and torch.equal(seen[0].mask, regular.mask)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("train", [False, True])
def test_sdpa_calls_meet_the_fused_cuda_kernels_conditions(train, autocast):
    # The CUDA memory-efficient kernel needs q/k/v and the mask with last-dim stride 1, the
    # mask in q's dtype, and the mask's other strides multiples of 8 (else torch copies it on
    # every call). With the planner's CUDA alignment on, every SDPA call must meet that, and
    # the number of calls must not grow with the batch (no Python loop over images).
    from torch.overrides import TorchFunctionMode

    calls = []

    class Recording(TorchFunctionMode):  # (the package calls torch's own function: no wrapper to patch)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                calls.append((*args[:3], kwargs.get("attn_mask", args[3] if len(args) > 3 else None)))
            return func(*args, **kwargs)

    model = SwinBackbone(**small_arch()).train(train)
    counts = []
    for batch in (1, 3):
        calls.clear()
        with ops.override(align_masks=True), torch.set_grad_enabled(train), Recording():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(torch.randn(batch, 3, 61, 75))
        counts.append(len(calls))
        assert calls
        for q, k, v, mask in calls:
            assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            assert mask is not None and mask.dtype == q.dtype
            assert mask.dim() == 4  # (CPU SDPA runs its math kernel, 3x slower, for a 3-d mask)
            assert mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1]), mask.stride()
        if autocast:
            assert {q.dtype for q, *_ in calls} == {torch.bfloat16}
    assert counts[0] == counts[1]
    # The masks were built once in the compute dtype (bf16 under autocast) and cached.
    dtype = torch.bfloat16 if autocast else torch.float32
    before = L.get_window_layout.cache_info()
    layout = L.get_window_layout(16, 19, 7, 3, True, torch.device("cpu"), dtype, True, False, 7)  # stage 1 of 61x75
    assert L.get_window_layout.cache_info().misses == before.misses
    assert layout.mask.dtype == dtype


def test_ops_and_model_imports_form_no_circle():
    # Every import statement of swin_backbone/ops and swin_backbone/model, function-level and
    # type-only ones included: the modules they import form no circle.
    import ast
    import os

    import swin_backbone

    root = os.path.dirname(os.path.dirname(os.path.abspath(swin_backbone.__file__)))
    graph = {}
    for package in ("ops", "model"):
        folder = os.path.join(root, "swin_backbone", package)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py"):
                continue
            module = f"swin_backbone.{package}" + ("" if name == "__init__.py" else f".{name[:-3]}")
            tree = ast.parse(open(os.path.join(folder, name)).read())
            here = module.split(".") if name == "__init__.py" else module.split(".")[:-1]
            targets = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                    targets |= {f"{base}.{a.name}" for a in node.names} | {base}
            graph[module] = targets
    edges = {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}
    assert "swin_backbone.ops.layouts" in edges["swin_backbone.ops.planner"]  # (the walk sees imports)

    def reaches(start, goal, seen):
        for t in edges[start]:
            if t == goal or (t not in seen and (seen.add(t) or reaches(t, goal, seen))):
                return True
        return False

    circles = sorted(m for m in edges if reaches(m, m, set()))
    assert not circles, f"modules on an import circle: {circles}"


def test_the_backbones_save_memory_argument_decides_lean_saves():
    # save_memory=None: the planner's device default (the CPU: on); True / False: on or off
    # whatever the device; an ops.override comes first. Bad values name the argument.
    torch.manual_seed(0)
    x = torch.randn(1, 3, 32, 32)
    seen = {}
    for value in (None, True, False):
        model = SwinBackbone(arch=None, embed_dims=8, depths=(2,), num_heads=(1,), window_size=4,
                             out_indices=(0,), save_memory=value).train()
        seen[value] = [stage.save_memory for stage in ops.plan_stages(x, model)]
        with ops.override(save_memory=True):
            assert ops.plan_stages(x, model)[0].save_memory
        with torch.no_grad():
            assert not ops.plan_stages(x, model)[0].save_memory  # (inference keeps nothing anyway)
    assert seen == {None: [True], True: [True], False: [False]}
    for bad in ("yes", 2, "False"):
        with pytest.raises(ValueError, match=r"^save_memory: expected True or False, got"):
            SwinBackbone(arch=None, embed_dims=8, depths=(2,), num_heads=(1,), out_indices=(0,), save_memory=bad)


def _facts_by_modules(model, root=True):
    """read_modules' facts written out with ``modules()`` and ``getattr`` (the reference)."""
    hooks = torch.nn.modules.module
    types = planner.EXACT_TORCH_MODULES + tuple(planner.EXACT_SWIN_MODULES)
    plain = not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks)
    grad = stochastic = attn = False
    for m in model.modules():
        if m.training:
            attn = attn or getattr(m, "attn_drop_rate", 0.0) > 0
            stochastic = stochastic or (isinstance(m, torch.nn.Dropout) and m.p > 0) or getattr(m, "drop_prob", 0.0) > 0
        for p in m._parameters.values():
            if p is not None:
                grad = grad or p.requires_grad
                plain = plain and ((root and m is model) or isinstance(p, torch.nn.Parameter))
        if not (root and m is model):
            plain = plain and type(m) in types and not m._forward_hooks and not m._forward_pre_hooks
    return plain, grad, stochastic or attn, attn


def _rated(cls, name, value):
    """A subclass of ``cls`` whose ``name`` rate is a property (not an instance attribute)."""
    return type(f"Rated{cls.__name__}", (cls,), {name: property(lambda self: value)})


@pytest.mark.parametrize("change", ["none", "hook_on_a_part", "hook_in_a_stage", "hook_outside_the_parts", "global_hook",
                                    "tensor_not_parameter", "frozen_stage", "dropout", "drop_path", "attn_dropout",
                                    "attn_dropout_property", "drop_path_property", "subclass_outside_the_parts"])
@pytest.mark.parametrize("train", [False, True])
def test_read_modules_in_one_walk_says_what_each_module_says(change, train):
    # The backbone's facts, read once per module (stages apart), equal every module's own reading.
    model = SwinBackbone(**small_arch())
    handle = None
    block = model.stages[1].blocks[0]
    if change == "hook_on_a_part":
        handle = model.patch_embed.register_forward_hook(lambda *a: None)
    elif change == "hook_in_a_stage":
        handle = block.mlp.fc1.register_forward_pre_hook(lambda *a: None)
    elif change == "hook_outside_the_parts":
        handle = model.norm0.register_forward_hook(lambda *a: None)
    elif change == "global_hook":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    elif change == "tensor_not_parameter":
        block.mlp.fc2._parameters["weight"] = block.mlp.fc2.weight.detach()  # (as torch.func.functional_call)
    elif change == "frozen_stage":
        model.stages[0].requires_grad_(False)
    elif change == "dropout":
        block.mlp.drop1 = torch.nn.Dropout(0.1)
    elif change == "drop_path":
        block.drop_path = DropPath(0.2)
    elif change == "attn_dropout":
        block.attn.attn_drop_rate = 0.1
    elif change == "attn_dropout_property":
        block.attn.__class__ = _rated(type(block.attn), "attn_drop_rate", 0.1)
    elif change == "drop_path_property":
        rated = _rated(DropPath, "drop_prob", 0.3)
        block.drop_path = rated.__new__(rated)  # (DropPath's __init__ would set the property)
        torch.nn.Module.__init__(block.drop_path)
    elif change == "subclass_outside_the_parts":
        model.norm3.__class__ = type("Norm", (torch.nn.LayerNorm,), {})
    model.train(train)
    try:
        parts = (model.patch_embed, *model.stages)
        whole, each = planner.read_modules(model, parts)
        assert whole == _facts_by_modules(model)
        assert planner.read_modules(model) == (whole, [])
        assert [f[1:] for f in each] == [_facts_by_modules(p, root=False)[1:] for p in parts]
        expected_plain = change in ("none", "frozen_stage", "dropout", "drop_path", "attn_dropout")
        assert whole[0] == expected_plain
        assert whole[2] == (train and change in ("dropout", "drop_path", "attn_dropout", "attn_dropout_property",
                                                 "drop_path_property"))
        assert whole[3] == (train and change in ("attn_dropout", "attn_dropout_property"))
        if change == "frozen_stage":
            assert not each[1][1] and each[2][1]
    finally:
        if handle is not None:
            handle.remove()
