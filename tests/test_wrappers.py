"""What users wrap a backbone in (issue #35): every declared submodule runs as that module, on
every path, so that hooks, LoRA, quantization, tracing, ONNX export, FLOP counting, FSDP2 and
module surgery see the model they were given.

Each row runs on mmdet's ``SwinTransformer`` of the same small architecture as a control (it
shows the test itself is sound: mmdet's backbone is plain modules called in order) and on
``SwinBackbone``; every check compares a model with a wrapper against the same computation with
plain modules (weights changed the way the wrapper changes them), against itself in another
mode, or against mmdet. Small model: 2 stages, window 4, input ``2 x 3 x 37 x 45`` (odd sizes:
window padding, padding masks and the shift are all active). Hooks and wrapped modules also run
on ``SwinV2Backbone`` (``ours-v2``), and the tensors hooks are handed are checked on both
versions with the output options whose fast paths write in place (``channels_last_outputs``,
per-image ``valid_sizes``, V2 without a qkv bias).
"""
from __future__ import annotations

import copy
import datetime
import math
import os
import re
import socket
import subprocess
import sys
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swin_backbone import SwinBackbone, SwinV2Backbone

from .helpers import randomize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = dict(embed_dims=32, depths=(2, 2), num_heads=(1, 2), window_size=4, drop_path_rate=0.0, out_indices=(0, 1))
INPUT = (2, 3, 37, 45)
KINDS = ["mmdet", "ours"]
#: The kinds of the hook and wrapped-module rows: also Swin V2 (same module names as ours, plus
#: the position-bias MLP ``attn.cpb_mlp``, whose input is the table's coordinates, not tokens).
HOOK_KINDS = KINDS + ["ours-v2"]
#: eval under no_grad (inference, activation capture); eval with gradients (Grad-CAM's setting);
#: training (drop_path 0, no dropout: deterministic).
MODES = ["eval_no_grad", "eval_grad", "train"]
Outputs = Tuple[torch.Tensor, ...]

#: Where each part of a Swin block lives: ours, mmdet's (``FFN.layers`` is
#: ``Sequential(Sequential(fc1, act, drop), fc2, drop)``).
PARTS = {
    "qkv": ("attn.qkv", "attn.w_msa.qkv"),
    "proj": ("attn.proj", "attn.w_msa.proj"),
    "fc1": ("mlp.fc1", "ffn.layers.0.0"),
    "act": ("mlp.act", "ffn.layers.0.1"),
    "fc2": ("mlp.fc2", "ffn.layers.1"),
    "attn": ("attn", "attn"),
    "mlp": ("mlp", "ffn"),
    "norm1": ("norm1", "norm1"),
    "norm2": ("norm2", "norm2"),
}


# ------------------------------------------------------------------------------------ helpers
def build(kind: str, **options) -> nn.Module:
    """The small model (non-trivial norms, biases and position-bias tables), in eval mode;
    ``options``: more arguments of ours."""
    if kind == "mmdet":
        from mmdet.models.backbones import SwinTransformer

        model = SwinTransformer(**ARCH, strides=(4, 2))
    elif kind == "ours-v2":
        model = SwinV2Backbone(**ARCH, **options)
    else:
        model = SwinBackbone(**ARCH, **options)
    return randomize(model)


def part_path(kind: str, role: str) -> str:
    """Where a block holds ``role`` (a key of :data:`PARTS`) in ``kind``'s model."""
    return PARTS[role][1 if kind == "mmdet" else 0]


def part(model: nn.Module, kind: str, stage: int, block: int, role: str) -> nn.Module:
    """Block ``block`` of stage ``stage``'s ``role``."""
    return model.stages[stage].blocks[block].get_submodule(part_path(kind, role))


def linears(model: nn.Module) -> Dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def set_mode(model: nn.Module, mode: str) -> None:
    model.train(mode == "train")  # (mmdet's train() returns None: no chaining)


def run(model: nn.Module, x: torch.Tensor, mode: str, forward: Optional[Callable[[torch.Tensor], Outputs]] = None
        ) -> Tuple[Outputs, Optional[torch.Tensor]]:
    """The outputs (detached) and, where ``mode`` has gradients, the input's gradient of a
    fixed random weighting of them (``None`` under no_grad)."""
    set_mode(model, mode)
    forward = forward or model
    if mode == "eval_no_grad":
        with torch.no_grad():
            return tuple(forward(x)), None
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        outs = tuple(forward(x))
        generator = torch.Generator().manual_seed(1)
        sum((o * torch.randn(o.shape, generator=generator)).sum() for o in outs).backward()
    return tuple(o.detach() for o in outs), x.grad


def assert_outputs_close(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], tol: float, what: str) -> None:
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol, msg=lambda m: f"{what}, output {i}: {m}")


def loss_of(outs: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum(o.square().mean() for o in outs)


def stage_maps(size: Sequence[int]) -> List[Tuple[int, int]]:
    """Token map ``(h, w)`` per stage: patch 4, then halved (ceil)."""
    h, w = math.ceil(size[0] / 4), math.ceil(size[1] / 4)
    maps = [(h, w)]
    for _ in ARCH["depths"][1:]:
        h, w = math.ceil(h / 2), math.ceil(w / 2)
        maps.append((h, w))
    return maps


def allowed_rows(name: str, shape: Sequence[int]) -> Tuple[int, int]:
    """Rows (tokens) a token-wise module named ``name`` must see in one call for an input of
    ``shape``: every token of its stage's map, or all of them padded to whole windows (attention
    may project padded windows, as mmdet does). Fewer means the module ran on a chunk of them."""
    match = re.match(r"stages\.(\d+)\.downsample", name)
    if name.startswith("patch_embed"):
        stage = 0
    elif match:
        stage = int(match.group(1)) + 1
    else:
        stage = int(re.match(r"(?:norm|stages\.)(\d+)", name).group(1))
    h, w = stage_maps(shape[2:])[stage]
    ws = ARCH["window_size"]
    batch = shape[0]
    return batch * h * w, batch * math.ceil(h / ws) * ws * math.ceil(w / ws) * ws


def watched(model: nn.Module, kind: str) -> Dict[str, nn.Module]:
    """Every nn.Linear / nn.LayerNorm / nn.GELU, and each block, its attention and its MLP."""
    modules = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm, nn.GELU))}
    for s, stage in enumerate(model.stages):
        for b, block in enumerate(stage.blocks):
            modules[f"stages.{s}.blocks.{b}"] = block
            for role in ("attn", "mlp"):
                modules[f"stages.{s}.blocks.{b}.{part_path(kind, role)}"] = part(model, kind, s, b, role)
            if kind == "mmdet":
                modules[f"stages.{s}.blocks.{b}.attn.w_msa"] = block.attn.w_msa
    return modules


# ------------------------------------------------------------ 1. forward hooks see every module
#: The small input in every mode, and in inference one whose stage-0 MLP activations
#: (34060 tokens x 128 x 4 bytes = 17 MB) are larger than a CPU row chunk of today's code
#: (4-16 MiB): module calls must not be split into chunks there either.
HOOK_RUNS = [(mode, INPUT) for mode in MODES] + [("eval_no_grad", (2, 3, 517, 523))]


@pytest.mark.parametrize("mode, shape", HOOK_RUNS, ids=[f"{m}-{s[2]}x{s[3]}" for m, s in HOOK_RUNS])
@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_forward_hooks_fire_once_per_module_with_whole_tensors(kind, mode, shape):
    # Activation capture, Grad-CAM, feature visualisation: a forward hook on each module fires
    # exactly once per forward, with every token of its stage (not a chunk of them).
    model = build(kind)
    modules = watched(model, kind)
    calls: Dict[str, List[Tuple[int, ...]]] = defaultdict(list)
    recording = [True]

    def recorder(name: str):
        def hook(module, args, output):
            if not recording[0]:
                return
            if isinstance(module, (nn.Linear, nn.LayerNorm, nn.GELU)):
                x = args[0]
                width = module.in_features if isinstance(module, nn.Linear) else x.shape[-1]
                out_width = module.out_features if isinstance(module, nn.Linear) else output.shape[-1]
                calls[name].append((x.shape[-1] == width, x.numel() // width, output.numel() // out_width))
            else:
                calls[name].append(())
        return hook

    handles = [m.register_forward_hook(recorder(n)) for n, m in modules.items()]
    try:
        set_mode(model, mode)
        x = torch.randn(*shape)
        with torch.set_grad_enabled(mode != "eval_no_grad"):
            outs = model(x)
        recording[0] = False
        if mode != "eval_no_grad":
            # Backward may run modules again: activation checkpointing (torch.utils.checkpoint)
            # recomputes a block's forward in backward, hooks included; that is torch's
            # documented behaviour, so only the forward's calls are counted above.
            loss_of(outs).backward()
    finally:
        for h in handles:
            h.remove()
    tensor_modules = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.LayerNorm))]
    fired = [n for n in tensor_modules if calls[n]]
    never = [n for n in modules if not calls[n]]
    repeated = {n: len(c) for n, c in calls.items() if len(c) > 1}
    assert not never and not repeated, (
        f"{kind} {mode}: {len(fired)} of {len(tensor_modules)} Linear / LayerNorm hooks fired; "
        f"never: {never}; more than once per forward: {repeated}"
    )
    partial = {}
    for name, (call,) in calls.items():
        if "cpb_mlp" in name:  # (V2's position-bias MLP: one call on the table's coordinates)
            continue
        if call and (not call[0] or call[1] != call[2] or call[1] not in allowed_rows(name, shape)):
            partial[name] = call[1:] + (allowed_rows(name, shape),)
    assert not partial, f"{kind} {mode}: (rows in, rows out, rows expected) of modules given part of a map: {partial}"


# ------------------------------------------- 1b. what a hook was handed stays what it was handed
#: Per-image valid sizes of :data:`INPUT`'s two images (image-exact batches): the second one is
#: cut at odd sizes in both directions.
VALID_SIZES = ((37, 45), (25, 30))

#: id -> (kind, options, valid_sizes): the configurations whose fast paths write into tensors in
#: place (without hooks): V2's cosine normalisation of the qkv Linear's own output (no qkv bias
#: to add first), the output norms' zeroing beyond each image in channels-last views, and the
#: residual adds into the MLP's output.
KEPT_OUTPUT_RUNS = {
    "v1": ("ours", {}, None),
    "v1-channels-last-valid-sizes": ("ours", dict(channels_last_outputs=True), VALID_SIZES),
    "v2-no-qkv-bias": ("ours-v2", dict(qkv_bias=False), None),
    "v2-channels-last-valid-sizes": ("ours-v2", dict(channels_last_outputs=True, pad_small_map=True), VALID_SIZES),
}

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("run_id", list(KEPT_OUTPUT_RUNS))
def test_tensors_handed_to_forward_hooks_are_never_written_afterwards(run_id, mode):
    # Activation recorders, Grad-CAM tools and feature caches keep the tensor a forward hook is
    # handed. Every module's output keeps, after the forward (and backward), the values it had
    # when the hook returned: a reference copy taken in the hook equals the kept tensor.
    kind, options, valid_sizes = KEPT_OUTPUT_RUNS[run_id]
    model = build(kind, **options)
    kept: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)

    def keeper(name: str):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                kept[name].append((output, output.detach().clone()))
        return hook

    handles = [m.register_forward_hook(keeper(n)) for n, m in model.named_modules() if n]
    try:
        set_mode(model, mode)
        with torch.set_grad_enabled(mode != "eval_no_grad"):
            outs = model(torch.randn(*INPUT), valid_sizes=valid_sizes)
        if mode != "eval_no_grad":
            loss_of(outs).backward()
    finally:
        for h in handles:
            h.remove()
    watched = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm))]
    assert not [n for n in watched if not kept[n]], "Linear / LayerNorm hooks that never fired"
    if options.get("channels_last_outputs"):
        assert all(o.is_contiguous(memory_format=torch.channels_last) for o in outs)
    if valid_sizes is not None:  # (the zeroing ran: beyond the second image the maps are zero)
        assert all(o[1, :, math.ceil(25 / 4 / 2 ** i):].abs().max() == 0 for i, o in enumerate(outs))
    changed = {name: max((t.detach() - copy).abs().max().item() for t, copy in pairs)
               for name, pairs in kept.items() if any(not torch.equal(t.detach(), copy) for t, copy in pairs)}
    assert not changed, f"{run_id} {mode}: outputs written after their hook returned (largest change): {changed}"


# ------------------------------------ what a wrapper does flows on, as the plain computation's
def _hook(stage: int, block: int, role: str, pre: bool, fn: Callable, plain: Callable, plain_role: str = ""):
    """A case: a forward (pre-)hook ``fn`` on a block part; ``plain`` changes the weights of that
    part (or of the block's ``plain_role``) in place to compute what the hook makes it compute."""
    def wrap(model: nn.Module, kind: str):
        module = part(model, kind, stage, block, role)
        (module.register_forward_pre_hook if pre else module.register_forward_hook)(fn)

    def plain_change(model: nn.Module, kind: str) -> None:
        plain(part(model, kind, stage, block, plain_role or role))

    return wrap, plain_change


class DoublingLinear(nn.Linear):
    """A user's nn.Linear subclass with its own forward (here: twice the weight); counts calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return F.linear(x, 2 * self.weight, self.bias)


class Doubled(nn.Module):
    """A parametrization: the weight used is twice the stored one."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def _double_linear_weights(model: nn.Module, kind: str) -> None:
    for linear in linears(model).values():
        linear.weight.mul_(2)


def _subclass_linears(model: nn.Module, kind: str):
    for linear in linears(model).values():
        linear.__class__ = DoublingLinear  # same parameters, the subclass's forward


def _parametrize_linears(model: nn.Module, kind: str):
    from torch.nn.utils import parametrize

    for linear in linears(model).values():
        parametrize.register_parametrization(linear, "weight", Doubled())


def _functional_call(model: nn.Module, kind: str):
    # torch.func.functional_call: the forward with other parameters in the modules' places
    # (what torch.func transforms, MAML-style meta-learning and ensembling do).
    doubled = {f"{name}.weight": 2 * m.weight for name, m in linears(model).items()}
    return lambda x: torch.func.functional_call(model, doubled, (x,))


def _prune_linears(model: nn.Module, kind: str):
    # torch.nn.utils.prune recomputes ``weight = weight_orig * mask`` in a forward pre-hook.
    from torch.nn.utils import prune

    for linear in linears(model).values():
        prune.l1_unstructured(linear, "weight", amount=0.3)


def _pruned_weights(model: nn.Module, kind: str) -> None:
    from torch.nn.utils import prune

    for linear in linears(model).values():
        prune.l1_unstructured(linear, "weight", amount=0.3)
        prune.remove(linear, "weight")  # the masked weight as a plain parameter


#: id -> (wrap the model (returns a forward, or None: the model itself), the plain-module change
#: computing the same).
WRAPPERS = {
    "fc2-forward-hook-zeroes-output": _hook(
        0, 1, "fc2", False, lambda m, args, out: out * 0,
        lambda fc2: (fc2.weight.zero_(), fc2.bias.zero_())),
    "qkv-forward-pre-hook-doubles-input": _hook(
        1, 0, "qkv", True, lambda m, args: (args[0] * 2,), lambda qkv: qkv.weight.mul_(2)),
    "proj-forward-hook-negates-output": _hook(
        0, 0, "proj", False, lambda m, args, out: -out, lambda proj: (proj.weight.neg_(), proj.bias.neg_())),
    "fc1-forward-pre-hook-halves-input": _hook(
        1, 1, "fc1", True, lambda m, args: (args[0] / 2,), lambda fc1: fc1.weight.div_(2)),
    "gelu-forward-hook-halves-output": _hook(  # fc2(a / 2) = (W / 2) a + b
        0, 0, "act", False, lambda m, args, out: out / 2, lambda fc2: fc2.weight.div_(2), "fc2"),
    "norm1-forward-hook-scales-output": _hook(
        1, 1, "norm1", False, lambda m, args, out: out * 1.5,
        lambda norm: (norm.weight.mul_(1.5), norm.bias.mul_(1.5))),
    "norm2-forward-hook-shifts-output": _hook(
        0, 1, "norm2", False, lambda m, args, out: out + 0.1, lambda norm: norm.bias.add_(0.1)),
    "linear-subclass-forward": (_subclass_linears, _double_linear_weights),
    "parametrize-linear-weights": (_parametrize_linears, _double_linear_weights),
    "functional-call-linear-weights": (_functional_call, _double_linear_weights),
    "prune-l1-linear-weights": (_prune_linears, _pruned_weights),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(WRAPPERS))
@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_wrapper_computes_what_the_plain_modules_compute(kind, case, mode):
    # The hook's return value (or the subclass's / parametrization's / pruned weight) is what
    # flows on: the backbone's outputs, and in grad modes the input's gradient, equal those of
    # the model whose weights were changed to compute the same.
    wrap, plain_change = WRAPPERS[case]
    model = build(kind)
    plain = copy.deepcopy(model)
    x = torch.randn(*INPUT)
    before, _ = run(model, x, mode)
    forward = wrap(model, kind)
    got, got_grad = run(model, x, mode, forward)
    with torch.no_grad():
        plain_change(plain, kind)
    expected, expected_grad = run(plain, x, mode)
    assert max((e - b).abs().max().item() for e, b in zip(expected, before)) > 1e-3, "the case changes nothing"
    assert_outputs_close(got, expected, 1e-5, f"{kind} {mode} {case}")
    if expected_grad is not None:
        # Relative to the gradient's largest magnitude: V2's cosine logits (scales up to 100)
        # reach 10-100 there, and the two models' fp32 backward formulas differ in rounding
        # (in float64 they agree to 1e-13).
        atol = 1e-5 * max(1.0, expected_grad.abs().max().item())
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=atol,
                                   msg=lambda m: f"{kind} {mode} {case}, input gradient: {m}")
    if case == "linear-subclass-forward":
        calls = {n: getattr(m, "calls", 0) for n, m in linears(model).items()}
        assert set(calls.values()) == {1}, f"calls of the subclass's forward per Linear: {calls}"


# torch.fx.symbolic_trace is not a row: neither mmdet's Swin nor ours is symbolically traceable
# (window padding and shifts depend on the input size; timm's Swin is not either).


@pytest.mark.parametrize("kind", KINDS)
def test_replacing_the_activation_changes_every_mode_alike(kind):
    # Module surgery: nn.GELU -> nn.ReLU in every block's MLP. Inference, inference with
    # gradients and training (deterministic here) compute the same function, which is not the
    # GELU one.
    model = build(kind)
    x = torch.randn(*INPUT)
    gelu, _ = run(model, x, "eval_no_grad")
    for s, stage in enumerate(model.stages):
        for b in range(len(stage.blocks)):
            parent, _, leaf = part_path(kind, "act").rpartition(".")
            setattr(stage.blocks[b].get_submodule(parent), leaf, nn.ReLU())
    relu = {mode: run(model, x, mode)[0] for mode in MODES}
    assert max((r - g).abs().max().item() for r, g in zip(relu["eval_no_grad"], gelu)) > 1e-3
    for mode in ("eval_grad", "train"):
        assert_outputs_close(relu[mode], relu["eval_no_grad"], 1e-5, f"{kind}: ReLU in {mode} vs eval_no_grad")


@pytest.mark.parametrize("kind", KINDS)
def test_pruned_model_trains(kind):
    # Two training steps with pruned Linears: the gradient reaches every ``weight_orig``
    # through the mask recomputed in each forward (zero where pruned), as in the plain model.
    from torch.nn.utils import prune

    model = build(kind)
    plain = copy.deepcopy(model)
    with torch.no_grad():
        _pruned_weights(plain, kind)
    _prune_linears(model, kind)
    model.train()
    plain.train()
    for step in range(2):
        x = torch.randn(*INPUT)
        model.zero_grad()
        plain.zero_grad()
        loss_of(model(x)).backward()
        loss_of(plain(x)).backward()
        for (name, m), p in zip(linears(model).items(), linears(plain).values()):
            assert m.weight_orig.grad is not None, f"{kind} step {step}: no gradient for {name}.weight_orig"
            torch.testing.assert_close(m.weight_orig.grad, p.weight.grad * m.weight_mask, rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"{kind} step {step}, {name}: {msg}")
    assert all(prune.is_pruned(m) for m in linears(model).values())


# ------------------------------------------------------------------------------- 2. peft LoRA
def _lora(kind: str):
    peft = pytest.importorskip("peft")
    model = build(kind)
    names = list(linears(model))
    # The names a user writes for our backbone; peft matches name suffixes, so "proj" also
    # adapts the patch embedding's Conv2d (patch_embed.proj). mmdet's Linears by full name.
    targets = ["qkv", "proj", "fc1", "fc2", "reduction"] if kind == "ours" else names
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    adapters = {n: p for n, p in lora.named_parameters() if "lora_A" in n or "lora_B" in n}
    unadapted = [n for n in names if f"base_model.model.{n}.lora_A.default.weight" not in adapters]
    assert not unadapted, f"Linears without a LoRA adapter: {unadapted}"
    with torch.no_grad():
        for name, p in adapters.items():
            if "lora_B" in name:  # peft starts B at zero (a no-op adapter): make it count
                p.normal_(std=0.05)
    return lora, adapters


@pytest.mark.parametrize("kind", KINDS)
def test_peft_lora_eval_equals_merged(kind):
    lora, _ = _lora(kind)
    x = torch.randn(*INPUT)
    lora.eval()
    with torch.no_grad():
        got = lora(x)
    merged = lora.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    merged.eval()
    with torch.no_grad():
        expected = merged(x)
    assert_outputs_close(got, expected, 1e-5, f"{kind}: LoRA model vs merge_and_unload()")


@pytest.mark.parametrize("kind", KINDS)
def test_peft_lora_trains_every_adapter(kind):
    lora, adapters = _lora(kind)
    lora.train()
    loss_of(lora(torch.randn(*INPUT))).backward()
    missing = [n for n, p in adapters.items() if p.grad is None or not p.grad.abs().sum() > 0]
    got = len(adapters) - len(missing)
    assert not missing, f"{kind}: {got} of {len(adapters)} LoRA tensors got a gradient; not: {missing}"


# -------------------------------------------------------------------- 3. dynamic quantization
@pytest.mark.parametrize("kind", KINDS)
def test_dynamic_quantization(kind):
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    # quantize_dynamic swaps modules whose type is exactly nn.Linear (mmcv's FFN uses its own
    # nn.Linear subclass: mmdet's MLPs stay fp32); ours are all plain nn.Linear.
    model = build(kind)
    plain = [n for n, m in linears(model).items() if type(m) is nn.Linear]
    assert kind == "mmdet" or len(plain) == len(linears(model))
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    assert not [n for n, m in linears(quantized).items() if type(m) is nn.Linear]
    assert sum(isinstance(m, DynamicQuantizedLinear) for m in quantized.modules()) == len(plain)
    x = torch.randn(*INPUT)
    with torch.no_grad():
        expected = model(x)
        got = quantized(x)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape
        cosine = F.cosine_similarity(g.flatten(), e.flatten(), dim=0).item()
        assert cosine > 0.99, f"{kind} output {i}: cosine similarity to fp32 {cosine}"


# -------------------------------------------------------------------------- 4. TorchScript trace
@pytest.mark.parametrize("kind", KINDS)
def test_jit_trace(kind):
    # A traced graph is fixed-size: it replays this input size's padding / windows / masks, so
    # it is compared at the traced size only.
    model = build(kind)
    x = torch.randn(*INPUT)
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,), check_trace=False)
        expected = model(x)
        got = traced(x)
    assert_outputs_close(got, expected, 1e-5, f"{kind}: traced vs eager")


# ------------------------------------------------------------- 5. ONNX (TorchScript exporter)
@pytest.mark.parametrize("kind", KINDS)
def test_onnx_export_runs_in_onnxruntime(kind, tmp_path):
    # The TorchScript-based exporter (dynamo=False) is what mmdeploy drives. Fixed size, as traced.
    pytest.importorskip("onnx", reason="the onnx extra (onnx) is not installed")
    ort = pytest.importorskip("onnxruntime", reason="the onnx extra (onnxruntime) is not installed")
    model = build(kind)
    x = torch.randn(*INPUT)
    path = str(tmp_path / "backbone.onnx")
    with torch.no_grad():
        torch.onnx.export(model, (x,), path, dynamo=False, opset_version=17, input_names=["x"])
        expected = model(x)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x.numpy()})
    assert_outputs_close([torch.from_numpy(g) for g in got], expected, 1e-4, f"{kind}: onnxruntime vs eager")


# ------------------------------------------------------------------------------------- 6. FLOPs
def test_flops_match_mmdet():
    # mmdet's tools/analysis_tools/get_flops.py calls mmengine's get_model_complexity_info,
    # whose "flops" is FlopAnalyzer(model, inputs).total(): a TorchScript trace counted per aten
    # op (called directly here: get_model_complexity_info traces once more for activations).
    # Swin-T at 224 x 224 is 4.5 GFLOPs in the Swin paper (multiply-adds); mmengine does not
    # count scaled_dot_product_attention (~3% of Swin-T), hence the 5% tolerance.
    from mmdet.models.backbones import SwinTransformer
    from mmengine.analysis import FlopAnalyzer

    x = torch.randn(1, 3, 224, 224)
    flops = {}
    for kind, model in (("mmdet", SwinTransformer()), ("ours", SwinBackbone("tiny"))):
        model.eval()
        flops[kind] = FlopAnalyzer(model, (x,)).total()
    assert abs(flops["mmdet"] / 4.5e9 - 1) < 0.05, flops  # the control counts what the paper says
    assert abs(flops["ours"] / flops["mmdet"] - 1) < 0.05, flops


# ----------------------------------------------------------------------------------- 7. FSDP2
def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4 - 2.5 kept FSDP2 private
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _fsdp_step(kind: str, fully_shard: Callable, rank: int, world: int) -> Dict[str, object]:
    """``kind``'s model with ``fully_shard`` on every block and on the whole, trained one step
    on this rank's batch; its gathered gradients against the unsharded model's on all ranks'
    batches (FSDP averages over ranks)."""
    torch.manual_seed(0)  # the same model on every rank
    model = build(kind)
    reference = copy.deepcopy(model)
    for stage in model.stages:
        for block in stage.blocks:
            fully_shard(block)
    fully_shard(model)
    model.train()
    reference.train()
    inputs = torch.randn(world, *INPUT, generator=torch.Generator().manual_seed(1))
    loss_of(model(inputs[rank])).backward()
    (sum(loss_of(reference(inputs[r])) for r in range(world)) / world).backward()
    worst, missing, count = 0.0, [], 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            continue
        count += 1
        if p.grad is None:
            missing.append(name)
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (grad - q.grad).abs().max().item())
    return dict(gradients=count, max_difference=worst, missing=missing)


def _fsdp_worker(out_dir: str, kinds: Sequence[str]) -> None:
    """One torchrun rank: :func:`_fsdp_step` for each kind, written to ``out_dir/rank<r>.json``."""
    import json

    import torch.distributed as dist

    fully_shard = _fully_shard()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for kind in kinds:
        try:
            results[kind] = _fsdp_step(kind, fully_shard, rank, world)
        except Exception as error:  # reported per kind: the other kind still runs
            results[kind] = dict(error=f"{type(error).__name__}: {error}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    # As the package's own ranks leave (tools/job.py): gloo's teardown at exit can abort a rank
    # ("terminate called without an active exception") after its results are written.
    from swin_backbone.tools.job import leave_job

    leave_job(0)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """One 2-rank torchrun (gloo, CPU) for both kinds: (per rank results, the run's log)."""
    import json

    try:
        _fully_shard()
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no FSDP2 fully_shard")
    out_dir = tmp_path_factory.mktemp("fsdp")
    kinds = [k for k in KINDS if k != "mmdet" or _has("mmdet")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "tests.test_wrappers", "fsdp", str(out_dir)] + kinds
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = f"exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    results = {}
    for rank in (0, 1):
        path = out_dir / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {}
    return results, log, proc.returncode


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.slow  # a 2-rank torchrun
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_fully_shard_per_block(kind, fsdp_run):
    # Two gloo ranks on the CPU (torchrun), each block its own FSDP2 unit: the gradients equal
    # the unsharded model's.
    if kind == "mmdet":
        pytest.importorskip("mmdet")
    results, log, returncode = fsdp_run
    for rank in (0, 1):
        result = results[rank].get(kind)
        assert result is not None, f"rank {rank} reported nothing for {kind}: {log}"
        assert "error" not in result, f"{kind} rank {rank}: {result['error']}"
        assert result["gradients"] > 0 and not result["missing"], f"{kind} rank {rank}: no gradient: {result}"
        assert result["max_difference"] < 1e-5, f"{kind} rank {rank}: gradients differ from the unsharded: {result}"
    assert returncode == 0, log


if __name__ == "__main__" and sys.argv[1:2] == ["fsdp"]:
    _fsdp_worker(sys.argv[2], sys.argv[3:])
