"""How Swin is computed: the functional interface the model modules call, each function
running what the :class:`~swin_backbone.ops.plan.Plan` of the forward names (docs/design.md).
The model reaches the ops only through these names.
"""
from .attention import KERNELS, window_attention, window_partition
from .cosine import continuous_position_bias, cosine_qkv  # Swin V2's logits for the same kernels
from .image_sizes import image_masked_layout, mask_input, sizes_tensor, stage_sizes, valid_map
from .layouts import WindowLayout, clear_caches
from .plan import Plan, Sizes
from .planner import PLAIN_SWIN_MODULES, override, plan_for, plan_forward, plan_stage, resolve_attention
from .regions import drop_samples, lean_saves, mlp_residual, output_nchw, row_chunks

__all__ = [
    "KERNELS", "PLAIN_SWIN_MODULES", "Plan", "Sizes", "WindowLayout", "clear_caches",
    "continuous_position_bias", "cosine_qkv", "drop_samples", "image_masked_layout", "lean_saves", "mask_input",
    "mlp_residual",
    "output_nchw", "override", "plan_for", "plan_forward", "plan_stage", "resolve_attention", "row_chunks",
    "sizes_tensor", "stage_sizes", "valid_map", "window_attention", "window_partition",
]
