"""Swin Transformer V2 (Liu et al. 2022) for dense prediction: what differs from V1.

V2 changes four things; everything else (patch embedding, window layouts and masks, padding,
stages, output norms, freezing, checkpointing, the planner and its kernels) is V1's:

* the block: residual post-norm, ``x = x + drop_path(norm1(attn(x)))``,
  ``x = x + drop_path(norm2(mlp(x)))`` (:class:`SwinBlockV2`), and for the huge / giant
  variants an extra LayerNorm ``norm3`` after every ``n``-th block of a stage;
* the attention logits: scaled cosine attention and a log-spaced continuous position bias
  (:class:`WindowAttentionV2`; the arithmetic lives in :mod:`swin_backbone.ops.cosine` and
  feeds the ordinary window-attention kernels);
* the qkv bias: learnable q and v biases, a zero k bias;
* patch merging: reduction ``4C -> 2C``, then LayerNorm of ``2C`` (:class:`PatchMergingV2`),
  in the official channel order.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import ops
from ..validation import check_int, check_per_stage, fail
from .backbone import SwinBackbone
from .blocks import Mlp, merge_2x2
from .presets import DEFAULT_WINDOW, resolve_arch

#: Hidden width of the continuous-position-bias MLP (official, timm, torchvision, mmpretrain).
CPB_HIDDEN_DIMS = 512


class WindowAttentionV2(nn.Module):
    """(Shifted) window attention with scaled cosine logits and a continuous position bias.

    ``softmax(cos(q, k) * exp(min(logit_scale, log 100)) + 16 sigmoid(cpb_mlp(coords)) + mask) v``
    per head, with ``q = x W_q + q_bias``, ``k = x W_k`` (zero bias), ``v = x W_v + v_bias``.

    Arguments as :class:`~swin_backbone.model.blocks.WindowAttention`'s, except: the position
    bias is evaluated on the ``(2 tw - 1)**2`` offsets of ``window_size`` ``tw`` (a smaller
    effective window reads a subset); ``pretrained_window_size``: window of the pre-training run
    whose weights are fine-tuned at ``window_size`` (coordinates are normalised by it), ``0``:
    ``window_size``; ``qkv_bias``: learnable q and v biases (k has none).
    """

    def __init__(self, embed_dims: int, num_heads: int, window_size: int, pretrained_window_size: int = 0,
                 qkv_bias: bool = True, attn_drop_rate: float = 0.0, proj_drop_rate: float = 0.0) -> None:
        super().__init__()
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.window_size = window_size
        self.pretrained_window_size = pretrained_window_size
        self.attn_drop_rate = attn_drop_rate
        self.logit_scale = nn.Parameter(torch.full((num_heads, 1, 1), math.log(10.0)))
        # (ReLU not in place, unlike timm's and the official: a hook that keeps the first Linear's
        # output keeps what it was handed; the table is small)
        self.cpb_mlp = nn.Sequential(nn.Linear(2, CPB_HIDDEN_DIMS, bias=True), nn.ReLU(),
                                     nn.Linear(CPB_HIDDEN_DIMS, num_heads, bias=False))
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=False)
        if qkv_bias:
            self.q_bias: Optional[nn.Parameter] = nn.Parameter(torch.zeros(embed_dims))
            self.v_bias: Optional[nn.Parameter] = nn.Parameter(torch.zeros(embed_dims))
        else:
            self.q_bias = self.v_bias = None
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop_rate)

    def qkv_bias(self) -> Optional[torch.Tensor]:
        """The qkv projection's bias: ``[q_bias, 0, v_bias]`` (``None`` without q / v biases)."""
        if self.q_bias is None:
            return None
        return torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias))

    def position_bias_table(self, plan: ops.Plan) -> torch.Tensor:
        """``((2 tw - 1)**2, nH)``: ``16 * sigmoid(cpb_mlp(log-spaced coordinates))``."""
        return ops.continuous_position_bias(self.cpb_mlp, self.window_size, self.pretrained_window_size, plan)

    def forward(self, x: torch.Tensor, layout: ops.WindowLayout) -> torch.Tensor:
        """``proj(attention(windows(x)))``: ``(B, H * W, C)`` -> ``(B, H * W, C)`` (no norm
        before: V2 normalises the branch's output); ``layout`` bound to the forward's plan."""
        qkv = self.qkv(ops.window_partition(x, layout))
        if self.q_bias is not None:  # (in qkv's dtype, as F.linear's bias under autocast)
            qkv = qkv + self.qkv_bias().to(qkv.dtype)
        qkv = ops.cosine_qkv(qkv, self.logit_scale, self.num_heads, layout.plan)  # (in place where the plan allows)
        out = ops.window_attention(qkv, self.position_bias_table(layout.plan), layout, num_heads=self.num_heads,
                                   scale=1.0, dropout_p=self.attn_drop_rate if self.training else 0.0)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return (f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, window_size={self.window_size}, "
                f"pretrained_window_size={self.pretrained_window_size}")


class SwinBlockV2(nn.Module):
    """Residual post-norm (shifted-)window attention + MLP (Swin V2).

    ``x = x + drop_path(norm1(attn(x)))``, ``x = x + drop_path(norm2(mlp(x)))``, then
    ``x = norm3(x)`` if ``extra_norm`` (huge / giant). Arguments as :class:`SwinBlock`, plus
    ``pretrained_window_size`` (see :class:`WindowAttentionV2`) and ``extra_norm``;
    ``qk_scale`` must be ``None`` (cosine attention has a learned scale instead).
    """

    def __init__(
        self, embed_dims: int, num_heads: int, window_size: int, shift: bool, mlp_ratio: float = 4.0,
        qkv_bias: bool = True, qk_scale: Optional[float] = None, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0, pretrained_window_size: int = 0, extra_norm: bool = False,
    ) -> None:
        super().__init__()
        if qk_scale is not None:
            fail("qk_scale", "None (Swin V2's cosine attention learns its scale: logit_scale)", qk_scale)
        self.shift = shift
        self.attn = WindowAttentionV2(
            embed_dims, num_heads, window_size, pretrained_window_size, qkv_bias, attn_drop_rate, drop_rate
        )
        self.norm1 = nn.LayerNorm(embed_dims)
        self.drop_path = ops.DropPath(drop_path_rate)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop_rate)
        self.norm2 = nn.LayerNorm(embed_dims)
        self.norm3 = nn.LayerNorm(embed_dims) if extra_norm else None

    def forward(self, x: torch.Tensor, layout: ops.WindowLayout) -> torch.Tensor:
        """``(B, H * W, C)`` -> ``(B, H * W, C)``."""
        x = x + self.drop_path(self.norm1(self.attn(x, layout)), layout)
        if layout.row_chunks is None:
            x = x + self.drop_path(self.norm2(self.mlp(x)), layout)
        else:
            rows = x.view(-1, x.shape[-1])
            for part in layout.row_chunks:  # (CPU inference: cache-sized rows, added in place)
                rows[part].add_(self.norm2(self.mlp(rows[part])))
        return x if self.norm3 is None else self.norm3(x)

    def reset_post_norms(self) -> None:
        """Zero ``norm1`` / ``norm2`` (official ``_init_respostnorm``): every residual
        branch starts at 0, so a model trained from scratch starts as the identity."""
        for norm in (self.norm1, self.norm2):
            nn.init.zeros_(norm.weight)
            nn.init.zeros_(norm.bias)


class PatchMergingV2(nn.Module):
    """2x2 neighbourhood concatenation + linear reduction ``4C -> 2C`` + LayerNorm of ``2C``.

    Odd sizes are padded bottom/right with zeros first (with per-image valid sizes a stage
    returns zeros beyond each image: as for the image alone); channels in the official order
    ``x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]`` (as V1's
    :class:`PatchMerging`). ``(B, H, W, C)`` -> ``(B, ceil(H / 2), ceil(W / 2), 2C)``.
    """

    def __init__(self, embed_dims: int, out_dims: Optional[int] = None, norm: bool = True) -> None:
        super().__init__()
        out_dims = out_dims or 2 * embed_dims
        self.reduction = nn.Linear(4 * embed_dims, out_dims, bias=False)
        self.norm = nn.LayerNorm(out_dims) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.reduction(merge_2x2(x)))


class SwinV2Backbone(SwinBackbone):
    """Swin Transformer V2 backbone emitting stage 1-4 feature maps, correct at any input size.

    Arguments as :class:`~swin_backbone.SwinBackbone` (same meaning, same mmdet / mmseg
    drop-in forms), except (docs/swin-v2.md):

    Args:
        arch: ``'tiny'`` ... ``'giant'`` (or initials), or a published model name
            (:data:`~swin_backbone.model.presets.PUBLISHED_V2`), which also sets ``window_size``
            and ``pretrained_window_sizes`` unless they are given.
        window_size: an int or one per stage (default 8, or the published model's).
        pretrained_window_sizes: per stage (or one int), the window the weights were pre-trained
            with, which normalises the position-bias coordinates; ``0`` (default): the stage's own.
        extra_norm_every_n_blocks: an extra LayerNorm (``norm3``) after blocks ``n - 1, 2n - 1, ...``
            of every stage (counted from 0 in each stage, as mmpretrain's huge / giant); ``0``: none.
            Default: the preset's.
        qkv_bias: learnable q and v biases (the k bias is always zero).
        qk_scale: must be ``None``: cosine attention learns a per-head ``logit_scale``.
        pad_small_map: default ``False`` here, Swin V2's own rule (official, timm, torchvision,
            transformers, mmpretrain): where a stage's map is not larger than the window the
            window shrinks to it and the shift is off, so a loaded checkpoint gives its source
            model's features at that model's input size (256x256, window 8: stage 4). ``True``
            (mmdet's rule, SwinBackbone's default) pads small maps up to the window; image-exact
            batches (``valid_sizes``) need it, and the shipped V2 detection / segmentation configs
            set it; loading a foreign V2 checkpoint then says once that small maps differ from
            the checkpoint's model (docs/swin-v2.md).

    ``init_weights`` zeroes every block's post-norms ``norm1`` / ``norm2`` after V1's init
    (official ``_init_respostnorm``) and sets ``logit_scale = log 10``, q / v biases 0; a
    ``Pretrained`` ``init_cfg`` then loads any V2 checkpoint format (V1 ones are refused).
    """

    #: Swin version of this backbone's parameters (checked against checkpoints).
    swin_version = 2

    def __init__(
        self, arch: Optional[str] = "tiny", embed_dims: Optional[int] = None, depths: Optional[Sequence[int]] = None,
        num_heads: Optional[Sequence[int]] = None, window_size: Optional[Union[int, Sequence[int]]] = None,
        pretrained_window_sizes: Optional[Union[int, Sequence[int]]] = None,
        extra_norm_every_n_blocks: Optional[int] = None, qk_scale: Optional[float] = None,
        pad_small_map: bool = False, **kwargs: Any,
    ) -> None:
        if qk_scale is not None:
            fail("qk_scale", "None (Swin V2's cosine attention learns its scale: logit_scale)", qk_scale)
        values, published = resolve_arch(arch, 2, embed_dims=embed_dims, depths=depths, num_heads=num_heads,
                                         extra_norm_every_n_blocks=extra_norm_every_n_blocks)
        depths, extra = values["depths"], values.get("extra_norm_every_n_blocks", 0)
        window = window_size if window_size is not None else published.get("window_size", DEFAULT_WINDOW[2])
        if pretrained_window_sizes is None:
            pretrained_window_sizes = published.get("pretrained_window_sizes", 0)
        pretrained = check_per_stage("pretrained_window_sizes", pretrained_window_sizes, len(depths), 0)
        extra = check_int("extra_norm_every_n_blocks", extra, minimum=0)
        options = [
            [dict(pretrained_window_size=pretrained[i], extra_norm=bool(extra) and (j + 1) % extra == 0)
             for j in range(depth)]
            for i, depth in enumerate(depths)
        ]
        super().__init__(arch=None, embed_dims=values["embed_dims"], depths=depths, num_heads=values["num_heads"],
                         window_size=window, block=SwinBlockV2, merging=PatchMergingV2, block_options=options,
                         pad_small_map=pad_small_map, **kwargs)
        self.pretrained_window_sizes = pretrained
        self.extra_norm_every_n_blocks = extra

    def _default_init(self) -> None:
        super()._default_init()
        for module in self.modules():
            if isinstance(module, SwinBlockV2):
                module.reset_post_norms()
            elif isinstance(module, WindowAttentionV2):
                with torch.no_grad():
                    module.logit_scale.fill_(math.log(10.0))
                    if module.q_bias is not None:
                        module.q_bias.zero_()
                        module.v_bias.zero_()  # type: ignore[union-attr]

    @staticmethod
    def no_weight_decay_keywords() -> Tuple[str, ...]:
        """Parameter-name parts the official recipe excludes from weight decay."""
        return ("cpb_mlp", "logit_scale", "relative_position_bias_table", "absolute_pos_embed")


ops.EXACT_SWIN_MODULES.extend((WindowAttentionV2, SwinBlockV2, PatchMergingV2))
