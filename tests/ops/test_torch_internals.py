"""The torch internals the ops read, named: a torch that renames them fails here, not silently.

``ops.LEAN_SAVES`` (swin_backbone/ops/attention.py) recognises LayerNorm, GELU and cast outputs by their
autograd node's class name and rebuilds them from the node's private ``_saved_*`` fields. If a
torch release renamed either, the pack hook would keep every tensor as usual: no error, only the
memory saving gone. These tests pin both, on this torch, through the hook itself."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from swin_backbone import ops
from swin_backbone.ops import attention


def _node_and_output(module: nn.Module, x: torch.Tensor):
    out = module(x)
    return out.grad_fn, out


@pytest.mark.parametrize("kind", ["layer_norm", "layer_norm_no_affine", "gelu", "gelu_tanh"])
def test_node_names_and_saved_fields_rebuild_the_output(kind):
    x = torch.randn(3, 5, 16, requires_grad=True)
    module = {"layer_norm": nn.LayerNorm(16), "layer_norm_no_affine": nn.LayerNorm(16, elementwise_affine=False),
              "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh")}[kind]
    node, out = _node_and_output(module, x)
    expected = attention._LAYER_NORM if kind.startswith("layer_norm") else attention._GELU
    assert type(node).__name__ == expected  # the name lean_saves matches
    if expected == attention._GELU:
        assert node._saved_self.equal(x) and node._saved_approximate == module.approximate
    else:
        assert node._saved_input.equal(x)
        assert node._saved_result1.shape == node._saved_result2.shape == (3, 5, 1)  # mean, 1 / std
        assert (node._saved_weight is None) == (kind == "layer_norm_no_affine")
    # the hook packs the output as "rebuild me" (not the tensor), and unpacks exactly it
    packed = attention._pack(out)
    assert not isinstance(packed, torch.Tensor), f"lean_saves no longer recognises {type(node).__name__}"
    assert (attention._unpack(packed) - out).abs().max() <= 1e-6


def test_a_cast_after_a_norm_is_rebuilt():
    # autocast's cast before a linear (ToCopyBackward0 on the norm's output)
    x = torch.randn(4, 16, requires_grad=True)
    norm = nn.LayerNorm(16)
    cast = norm(x).to(torch.bfloat16)
    assert type(cast.grad_fn).__name__ == attention._CAST
    packed = attention._pack(cast)
    assert not isinstance(packed, torch.Tensor)
    assert attention._unpack(packed).equal(cast)


def test_under_lean_saves_a_linear_keeps_no_norm_output():
    # end to end: the saved-tensor hooks see the norm output the linear saves, and keep a rebuild
    norm, linear = nn.LayerNorm(16), nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    plan = ops.plan_for(x, grad=True, save_memory=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(attention._pack(t)) or t, lambda t: t):
        linear(norm(x))
    assert any(not isinstance(k, torch.Tensor) for k in kept), "the norm output was kept as a tensor"
    with ops.LEAN_SAVES[plan.save_memory]:
        y = linear(norm(x)).sum()
    y.backward()
    expected = torch.autograd.grad(linear(norm(x)).sum(), x)[0]
    assert (x.grad - expected).abs().max() <= 1e-6
