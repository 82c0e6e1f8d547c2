"""How Swin is computed: the functional interface the model modules call, each function
running what the :class:`~swin_backbone.ops.plan.Plan` of the forward names (docs/design.md).
The model reaches the ops only through these names.
"""
from .attention import KERNELS, LEAN_SAVES, DropPath, window_attention, window_partition
from .cosine import continuous_position_bias, cosine_qkv  # Swin V2's logits for the same kernels
from .image_sizes import mask_input, stage_sizes, stage_valid_sizes
from .layouts import WindowLayout, clear_caches, output_nchw, row_chunks, sizes_tensor, valid_map
from .plan import Plan, Sizes
from .planner import EXACT_SWIN_MODULES, override, plan_for, plan_stages, resolve_attention, stage_layouts, tracing

__all__ = [
    "DropPath", "EXACT_SWIN_MODULES", "KERNELS", "LEAN_SAVES", "Plan", "Sizes", "WindowLayout", "clear_caches",
    "continuous_position_bias", "cosine_qkv", "mask_input", "output_nchw", "override", "plan_for", "plan_stages",
    "resolve_attention", "row_chunks", "sizes_tensor", "stage_layouts", "stage_sizes", "stage_valid_sizes",
    "tracing", "valid_map", "window_attention", "window_partition",
]
