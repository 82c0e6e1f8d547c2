"""Helpers shared by test modules (fixtures are in conftest.py)."""
import socket

import torch

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
