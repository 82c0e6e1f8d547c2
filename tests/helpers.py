"""Helpers shared by test modules (fixtures are in conftest.py), and the table of newer-torch
features the compatibility suites skip on (:data:`FEATURES`)."""
import socket
import sys
from typing import Callable, Dict, Tuple

import torch

from swin_backbone import torch_compat

#: A tiny Swin: real structure (four stages of two blocks), 16 channels; fast on a CPU.
TINY = dict(arch=None, embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), drop_path_rate=0.0)


def randomize(model, std=0.1, position_mlp="cpb_mlp.2.weight"):
    """Non-trivial norms, biases, relative position bias tables and Swin V2 logit scales and
    position-bias MLP outputs (``position_mlp``: the parameter's name ending), so any layout
    error shows in the features; the model in eval mode, returned."""
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table") or (p.dim() == 1 and name.endswith("bias")):
                p.normal_(std=std)
            elif name.endswith("logit_scale"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 5.0))  # some above log(100): the clamp matters
            elif name.endswith(position_mlp):
                p.normal_(std=0.5)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, std)
    return model


def timm_stages(ref, x):
    """timm stage outputs ``(B, H, W, C)`` (no norm)."""
    y = ref.patch_embed(x)
    outs = []
    for layer in ref.layers:
        y = layer(y)
        outs.append(y)
    return outs


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test's own rendezvous: never a fixed number, which a
    concurrent run or a lingering socket can hold)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- torch features
#: Each newer-torch feature the package uses: ``name -> (test, what it needs, what happens
#: without it)``. The table of docs/compatibility.md; tests that need a feature carry
#: ``@pytest.mark.torch_feature(name)`` and skip, naming it, where it is missing (conftest.py).
FEATURES: Dict[str, Tuple[Callable[[], bool], str, str]] = {
    "sdpa_scale": (
        lambda: torch_compat.SDPA_HAS_SCALE,
        "scaled_dot_product_attention(scale=) (torch >= 2.1)",
        "the query is pre-scaled before SDPA (equal to rounding)",
    ),
    "compile": (
        lambda: torch_compat.compile_unsupported_reason() is None,
        "torch.compile on this Python (torch >= 2.1 on Python 3.11, >= 2.4 on 3.12)",
        "torch.compile raises in torch itself; the model runs eagerly",
    ),
    "compile_one_graph": (
        lambda: torch_compat.compile_unsupported_reason() is None and torch_compat.HAS_CUSTOM_OP,
        "torch.compile tracing a whole forward as one graph (seen on torch 2.14; torch 2.1's dynamo "
        "splits it into 80-96 graphs; versions between not tested, so torch >= 2.4 is assumed)",
        "torch.compile runs the forward as several graphs (graph breaks: slower compiled code)",
    ),
    "custom_op": (
        lambda: torch_compat.HAS_CUSTOM_OP,
        "torch.library.custom_op (torch >= 2.4)",
        "inside torch.compile graphs attention runs as plain SDPA instead of the fused Triton kernel "
        "(eager CUDA still uses the kernel)",
    ),
    "cpu_flash_sdpa": (
        lambda: hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
        "a flash SDPA kernel for CPU tensors (newer torch: not in 2.0 or 2.1)",
        "CPU attention runs SDPA's math kernel (same results, slower and more memory)",
    ),
    "export": (
        torch_compat.has_export,
        "torch.export.export with torch.export.Dim (torch >= 2.2)",
        "torch.export is missing in torch itself; TorchScript tracing / eager are unaffected",
    ),
    "onnx_dynamo": (
        torch_compat.onnx_export_has_dynamo,
        "torch.onnx.export(dynamo=True) (torch >= 2.5)",
        "the TorchScript-based ONNX exporter (torch.onnx.export without dynamo=True) is what remains",
    ),
    "safe_globals": (
        lambda: torch_compat.HAS_SAFE_GLOBALS,
        "torch.serialization.add_safe_globals (torch >= 2.4)",
        "swin_backbone loads checkpoints weights-only through its own restricted unpickler (same "
        "allow-list); mmengine's own torch.load calls are unrestricted on such torch (its default)",
    ),
    "load_mmap": (
        torch_compat.load_supports_mmap,
        "torch.load(mmap=True) (torch >= 2.1)",
        "files are read into memory instead of memory-mapped (same tensors)",
    ),
}


def has_feature(name: str) -> bool:
    """Whether the installed torch has feature ``name`` (a key of :data:`FEATURES`)."""
    return bool(FEATURES[name][0]())


def missing_reason(name: str) -> str:
    """One sentence: what ``name`` needs, the installed torch, and what happens instead."""
    _, needs, instead = FEATURES[name]
    return f"needs {needs}; the installed torch is {torch.__version__} (Python {sys.version.split()[0]}): {instead}"
