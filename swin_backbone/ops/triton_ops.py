"""The fused Triton window attention as the ``triton`` entry of the window-attention kernels
(:data:`~swin_backbone.ops.attention.KERNELS`), and as torch custom operators for
``torch.compile`` (one opaque call sized at run time, so sizes stay dynamic). Registered once
per process on import; the operators need torch >= 2.4 (else ``None``).
"""
from typing import Tuple

import torch

from ..torch_compat import HAS_CUSTOM_OP
from .attention import KERNELS, Kernel
from .layouts import WindowLayout
from .triton_attention import _backward, _forward, _plan, _TritonWindowAttention, stage_kernel

__all__ = ["window_attention_op", "window_attention_backward_op"]


def _run(qkv: torch.Tensor, table: torch.Tensor, bias: torch.Tensor, layout: WindowLayout, num_heads: int,
         scale: float, dropout_p: float, plan) -> torch.Tensor:
    """The :class:`~swin_backbone.ops.attention.Kernel`: ``(B, H * W, 3C)`` row-major ``qkv`` ->
    ``(B, H * W, C)``, eager or (tracing) as the operator; ``bias`` unused (the kernel reads the
    table), no dropout (the planner never names this kernel with attention dropout); the stage
    passed :func:`~.triton_attention.stage_kernel`."""
    sizes = (layout.height, layout.width, layout.window, layout.shift, layout.table_window, num_heads, float(scale))
    if not plan.tracing:
        return _TritonWindowAttention.apply(qkv, table, _plan(qkv, table, *sizes))
    if window_attention_op is None:
        raise RuntimeError("the fused Triton kernel inside torch.compile graphs needs torch.library.custom_op "
                           f"(torch >= 2.4); this is torch {torch.__version__}")
    return window_attention_op(qkv, table, *sizes)


if HAS_CUSTOM_OP:

    @torch.library.custom_op("swin_backbone::window_attention", mutates_args=())
    def window_attention_op(
        qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int, shift: int,
        table_window: int, num_heads: int, scale: float,
    ) -> torch.Tensor:
        """:func:`~swin_backbone.ops.triton_attention.triton_window_attention` as an operator:
        ``(B, H * W, 3C)`` row-major ``qkv`` -> ``(B, H * W, C)``."""
        plan = _plan(qkv, table, height, width, window, shift, table_window, num_heads, scale)
        return _forward(qkv, table, plan)

    @window_attention_op.register_fake
    def _(qkv, table, height, width, window, shift, table_window, num_heads, scale):
        return qkv.new_empty(qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3)

    @torch.library.custom_op("swin_backbone::window_attention_backward", mutates_args=())
    def window_attention_backward_op(
        grad_out: torch.Tensor, qkv: torch.Tensor, table: torch.Tensor, height: int, width: int, window: int,
        shift: int, table_window: int, num_heads: int, scale: float,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Gradients of :func:`window_attention_op` for ``qkv`` ``(B, H * W, 3C)`` and ``table``
        (always computed: a compiled graph cannot skip an operator's output)."""
        plan = _plan(qkv, table, height, width, window, shift, table_window, num_heads, scale)
        return _backward(grad_out, qkv, table, plan, True)

    @window_attention_backward_op.register_fake
    def _(grad_out, qkv, table, height, width, window, shift, table_window, num_heads, scale):
        # Contiguous, as the real ones (whatever qkv's and table's strides).
        return qkv.new_empty(qkv.shape), table.new_empty(table.shape)

    def _op_setup_context(ctx, inputs, output) -> None:
        qkv, table, *sizes = inputs
        ctx.save_for_backward(qkv, table)
        ctx.sizes = sizes

    def _op_backward(ctx, grad_out: torch.Tensor):
        qkv, table = ctx.saved_tensors
        grad_qkv, grad_table = window_attention_backward_op(grad_out, qkv, table, *ctx.sizes)
        return (grad_qkv, grad_table) + (None,) * len(ctx.sizes)

    window_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)
else:
    window_attention_op = window_attention_backward_op = None


KERNELS["triton"] = Kernel(_run, row_major=True, check=stage_kernel)
