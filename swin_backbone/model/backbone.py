"""SwinBackbone: the multi-scale Swin Transformer backbone for detection and segmentation."""
from __future__ import annotations

import logging

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmengine.model.weight_init import initialize, trunc_normal_
from torch import nn

from ..mmlab.dropin import InitCfg, translate_mmlab_args
from .blocks import PatchEmbed, PatchMerging, SwinBlock, SwinStage
from .presets import resolve_arch
from .. import ops
from ..torch_compat import is_compiling, register_load_state_dict_pre_hook
from ..mmlab.valid_sizes import attached_valid_sizes
from ..validation import check_config, check_input, check_valid_sizes

# The checkpoint package sits above the model and plugs into it when imported:
#: ``load_state_dict`` pre-hooks every backbone gets (the checkpoint key converter);
LOAD_STATE_DICT_PRE_HOOKS: List[Callable[..., None]] = []
#: the mmengine ``WEIGHT_INITIALIZERS`` entry that runs ``init_cfg=dict(type='Pretrained', ...)``.
PRETRAINED_INIT = "SwinBackbonePretrained"


class SwinBackbone(BaseModule):
    """Swin Transformer backbone emitting stage 1-4 feature maps, correct at any input size.

    Args:
        arch: ``'tiny'``, ``'small'``, ``'base'``, ``'large'`` (or ``'t'``/``'s'``/``'b'``/``'l'``);
            ``embed_dims`` / ``depths`` / ``num_heads`` given explicitly override it.
        embed_dims: channels ``C`` of stage 0; stage ``i`` has ``C * 2**i``.
        depths: blocks per stage.
        num_heads: attention heads per stage.
        in_channels: image channels.
        patch_size: patch-embedding stride (= kernel): ``P`` or ``(P, P)``.
        window_size: attention window (7; 12 for the 384-pretrained models), or one per stage.
        mlp_ratio: MLP hidden width / embed width.
        qkv_bias: learnable bias in the qkv projections.
        qk_scale: query scale; ``None`` means ``head_dim ** -0.5``.
        drop_rate: dropout after position embedding, attention projection and MLP.
        attn_drop_rate: dropout on attention weights.
        drop_path_rate: stochastic depth, rising linearly from 0 over all blocks.
        use_abs_pos_embed: add a learned absolute position embedding, stored at the
            ``pretrain_img_size / patch_size`` grid and resized (bicubic) to each input.
        pretrain_img_size: image size the absolute position embedding is stored for:
            ``S``, ``(S,)`` or ``(H, W)``.
        patch_norm: LayerNorm after patch embedding and inside patch merging.
        out_indices: stages whose outputs are returned, each after its own LayerNorm.
            Stages after the last one listed (and its patch merging) are built, so that
            checkpoints load as into the full model, but never run: their parameters get
            ``requires_grad=False`` (DDP requires a gradient for every trainable parameter).
        frozen_stages: ``-1`` freezes nothing; ``k >= 0`` freezes the patch embedding (and
            the absolute position embedding) and stages ``0 .. k-1`` with their output norms:
            their parameters get ``requires_grad=False`` at construction (DDP never sees
            them) and the modules stay in eval mode in ``train()``.
        with_cp: non-reentrant activation checkpointing per block (saves memory in training).
        pad_small_map: ``True`` (default, = mmdet): maps smaller than the window are padded
            up to it and still shifted. ``False`` (= official classification model): on a
            map whose smaller side is <= the window, the window shrinks to that side and the
            shift is off.
        mask_padding: ``True`` (default): tokens added by window padding form their own
            attention region, so real tokens never attend to them and features do not depend
            on how much an image was padded. ``False`` reproduces mmdet exactly.
        channels_last_outputs: ``False`` (default): outputs are contiguous NCHW tensors, as
            every downstream op expects (mmcv's CPU RoIAlign, for one, silently reads
            channels-last memory wrongly). ``True``: outputs are NCHW *views* of the
            channels-last tokens (``torch.channels_last`` memory), saving one copy per
            output, for necks and heads that handle any memory format (plain convs do).
        attention: the window-attention kernel on CUDA. ``'auto'`` (default): the fused
            Triton kernel or SDPA, whichever is faster among those that compute correctly on
            this GPU, measured once per kind of attention (:mod:`swin_backbone.ops.kernel_choice`);
            ``'sdpa'``: always SDPA; ``'triton'``: the fused kernel wherever it applies
            (windows up to 8x8), verified once, an error naming the reason where it cannot
            run. The environment variable ``SWIN_BACKBONE_ATTENTION`` (same values)
            overrides it. On the CPU every value but ``'triton'`` runs the CPU plan.

        The arguments below exist so that an mmdet 3.x / mmseg 1.x ``SwinTransformer`` config
        builds this backbone with ``type='SwinBackbone'`` and every other key unchanged; they
        mean what they mean there (see :mod:`swin_backbone.mmlab.dropin`). Values this
        backbone cannot honour are a ``ValueError`` naming the argument.

        strides: ``None``, or mmdet's one stride per stage: ``(patch_size, 2, 2, 2)`` (the
            patch-embedding stride, then the patch-merging strides) is the only possible value.
        act_cfg: ``None`` or ``dict(type='GELU')``, the activation of the MLPs.
        norm_cfg: ``None`` or ``dict(type='LN')`` (``requires_grad=True``, ``eps=1e-5``
            allowed), the norm everywhere in the backbone.
        pretrained: deprecated (as in mmdet and mmseg) checkpoint path; becomes
            ``init_cfg=dict(type='Pretrained', checkpoint=pretrained)`` with a warning. Giving
            both ``pretrained`` and ``init_cfg`` is an error.
        convert_weights: accepted for drop-in use of mmdet configs; checkpoint formats are
            detected automatically, so it has no effect.
        init_cfg: mmengine init config; ``dict(type='Pretrained', checkpoint=PATH)`` loads
            any supported Swin checkpoint format through :func:`swin_backbone.load_checkpoint`.

        The last arguments make variants (as torchvision's ``block=`` / ``downsample_layer=``;
        :class:`~swin_backbone.SwinV2Backbone` is one):

        block, merging: the block and patch-merging classes; they take the arguments of
            :class:`~swin_backbone.model.blocks.SwinBlock` / ``PatchMerging``.
        block_options: per stage, per block, extra keyword arguments for ``block``.

    Shapes:
        input ``(B, in_channels, H, W)``, any ``B, H, W >= 1``; output: a tuple with one
        ``(B, C * 2**i, H_i, W_i)`` tensor per ``i`` in ``out_indices``, where
        ``H_0 = ceil(H / patch_size)`` and each later stage halves it (ceil).
    """

    def __init__(
        self,
        arch: Optional[str] = "tiny",
        embed_dims: Optional[int] = None,
        depths: Optional[Sequence[int]] = None,
        num_heads: Optional[Sequence[int]] = None,
        in_channels: int = 3,
        patch_size: int = 4,
        window_size: Union[int, Sequence[int]] = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_scale: Optional[float] = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        use_abs_pos_embed: bool = False,
        pretrain_img_size: Union[int, Sequence[int]] = 224,
        patch_norm: bool = True,
        out_indices: Sequence[int] = (0, 1, 2, 3),
        frozen_stages: int = -1,
        with_cp: bool = False,
        pad_small_map: bool = True,
        mask_padding: bool = True,
        channels_last_outputs: bool = False,
        attention: str = "auto",
        strides: Optional[Sequence[int]] = None,
        act_cfg: Optional[Mapping[str, Any]] = None,
        norm_cfg: Optional[Mapping[str, Any]] = None,
        pretrained: Optional[str] = None,
        convert_weights: bool = False,
        init_cfg: Optional[InitCfg] = None,
        block: Callable[..., nn.Module] = SwinBlock,
        merging: Callable[..., nn.Module] = PatchMerging,
        block_options: Optional[Sequence[Sequence[Mapping[str, Any]]]] = None,
    ) -> None:
        values, _ = resolve_arch(arch, 1, embed_dims=embed_dims, depths=depths, num_heads=num_heads)
        embed_dims, depths, num_heads = values["embed_dims"], values["depths"], values["num_heads"]
        # mmdet / mmseg SwinTransformer argument forms -> ours (ValueError where impossible)
        mmlab = translate_mmlab_args(
            num_stages=len(depths),
            patch_size=patch_size,
            strides=strides,
            pretrain_img_size=pretrain_img_size,
            act_cfg=act_cfg,
            norm_cfg=norm_cfg,
            pretrained=pretrained,
            init_cfg=init_cfg,
        )
        super().__init__(init_cfg=mmlab.init_cfg)
        patch_size, pretrain_img_size = mmlab.patch_size, mmlab.pretrain_img_size
        out_indices = tuple(out_indices) if isinstance(out_indices, (list, tuple)) else out_indices
        windows = check_config(
            embed_dims=embed_dims,
            depths=depths,
            num_heads=num_heads,
            in_channels=in_channels,
            patch_size=patch_size,
            window_size=window_size,
            mlp_ratio=mlp_ratio,
            drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate,
            pretrain_img_size=pretrain_img_size,
            out_indices=out_indices,
            frozen_stages=frozen_stages,
            qk_scale=qk_scale,
            flags=dict(qkv_bias=qkv_bias, use_abs_pos_embed=use_abs_pos_embed, patch_norm=patch_norm, with_cp=with_cp,
                       pad_small_map=pad_small_map, mask_padding=mask_padding,
                       channels_last_outputs=channels_last_outputs, convert_weights=convert_weights),
        )
        self.arch = dict(embed_dims=embed_dims, depths=depths, num_heads=num_heads)
        self.embed_dims = embed_dims
        self.depths = depths
        self.num_heads = num_heads
        self.in_channels = in_channels
        self.patch_size = patch_size
        self.window_sizes = windows
        self.window_size = windows[0] if len(set(windows)) == 1 else windows
        self.out_indices = tuple(sorted(out_indices))
        self.frozen_stages = frozen_stages
        self.use_abs_pos_embed = use_abs_pos_embed
        self.drop_rate, self.attn_drop_rate, self.drop_path_rate = drop_rate, attn_drop_rate, drop_path_rate
        self.pad_small_map = pad_small_map
        self.mask_padding = mask_padding
        self.channels_last_outputs = channels_last_outputs
        self.attention = attention
        ops.check_attention(attention)
        self.num_stages = len(depths)
        self.num_features = tuple(embed_dims * 2**i for i in range(self.num_stages))

        self.patch_embed = PatchEmbed(in_channels, embed_dims, patch_size, norm=patch_norm)
        if use_abs_pos_embed:
            grid = (pretrain_img_size[0] // patch_size, pretrain_img_size[1] // patch_size)
            self.absolute_pos_embed = nn.Parameter(torch.zeros(1, embed_dims, *grid))
        else:
            self.absolute_pos_embed = None
        self.drop_after_pos = nn.Dropout(drop_rate)

        rates = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        self.stages = nn.ModuleList()
        for i, depth in enumerate(depths):
            first = sum(depths[:i])
            self.stages.append(
                SwinStage(
                    self.num_features[i],
                    depth,
                    num_heads[i],
                    drop_path_rates=rates[first : first + depth],
                    downsample=i < self.num_stages - 1,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    qk_scale=qk_scale,
                    drop_rate=drop_rate,
                    attn_drop_rate=attn_drop_rate,
                    patch_norm=patch_norm,
                    pad_small_map=pad_small_map,
                    mask_padding=mask_padding,
                    with_cp=with_cp,
                    window_size=windows[i],
                    block=block,
                    merging=merging,
                    block_options=None if block_options is None else block_options[i],
                )
            )
        for i in self.out_indices:
            self.add_module(f"norm{i}", nn.LayerNorm(self.num_features[i]))

        if convert_weights:
            print_log(
                "SwinBackbone: convert_weights is not needed; checkpoint formats are detected automatically.",
                logger="current",
            )
        for hook in LOAD_STATE_DICT_PRE_HOOKS:
            register_load_state_dict_pre_hook(self, hook)
        self._freeze_stages()

    # ------------------------------------------------------------------ freezing
    def frozen_modules(self) -> List[nn.Module]:
        """Modules frozen by ``frozen_stages`` (patch embed, stages ``< k``, their norms)."""
        if self.frozen_stages < 0:
            return []
        modules: List[nn.Module] = [self.patch_embed, self.drop_after_pos]
        for i in range(self.frozen_stages):
            modules.append(self.stages[i])
            if i in self.out_indices:
                modules.append(getattr(self, f"norm{i}"))
        return modules

    def unused_modules(self) -> List[nn.Module]:
        """Modules the forward never runs: stages after the last of ``out_indices`` and the
        patch merging after it."""
        last = self.out_indices[-1]
        modules: List[nn.Module] = list(self.stages[last + 1 :])
        if self.stages[last].downsample is not None:
            modules.append(self.stages[last].downsample)
        return modules

    def _freeze_stages(self) -> None:
        if self.frozen_stages >= 0 and self.absolute_pos_embed is not None:
            self.absolute_pos_embed.requires_grad_(False)
        for module in self.frozen_modules():
            module.eval()
            module.requires_grad_(False)
        for module in self.unused_modules():
            module.requires_grad_(False)

    def train(self, mode: bool = True) -> "SwinBackbone":
        """Set train/eval mode; frozen modules always stay in eval mode."""
        super().train(mode)
        for module in self.frozen_modules():
            module.eval()
        return self

    # ------------------------------------------------------------------ init
    def init_weights(self) -> None:
        """Truncated-normal init, then any ``init_cfg`` (a ``Pretrained`` one loads last)."""
        cfgs = self.init_cfg if isinstance(self.init_cfg, list) else [self.init_cfg] if self.init_cfg else []
        pretrained = [c for c in cfgs if c.get("type") == "Pretrained"]
        others = [c for c in cfgs if c.get("type") != "Pretrained"]
        self._default_init()
        if others:
            initialize(self, others)
        for cfg in pretrained:
            initialize(self, dict(cfg, type=PRETRAINED_INIT))
        self._freeze_stages()
        self._is_init = True

    def _default_init(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("relative_position_bias_table") or name == "absolute_pos_embed":
                trunc_normal_(p, std=0.02)

    # ------------------------------------------------------------------ forward
    def position_embedding(self, height: int, width: int) -> torch.Tensor:
        """``(1, H, W, C)`` absolute position embedding resized (bicubic) to ``H x W``."""
        pos = self.absolute_pos_embed
        if pos.shape[-2:] != (height, width):
            pos = F.interpolate(pos, size=(height, width), mode="bicubic", align_corners=False)
        return pos.permute(0, 2, 3, 1)

    def forward(
        self, x: torch.Tensor, valid_sizes: Optional[Union[Sequence[Sequence[int]], torch.Tensor]] = None
    ) -> Tuple[torch.Tensor, ...]:
        """``(B, C_in, H, W)`` -> tuple of ``(B, C_i, H_i, W_i)`` per ``out_indices``.

        Args:
            x: the batch input; images sit at its top left, padded bottom / right.
            valid_sizes: per image, the ``(h, w)`` in input pixels that is the image: a
                sequence of ``B`` pairs or a ``(B, 2)`` int tensor; ``None``: each image is
                the whole input. Everything beyond an image's valid size is then treated
                like window padding at every stage (its own attention region, zeros where
                patch merging reads it), and the returned maps are zero beyond
                ``ceil(h / (patch_size * 2**i)) x ceil(w / ...)`` at stage ``i``: image
                ``b``'s features over its valid region equal those of the image run alone
                at its exact size, whatever the batch and its padding. Needs
                ``mask_padding=True`` and ``pad_small_map=True``; with
                ``use_abs_pos_embed`` the position embedding is resized to each image's own
                size. A batch made by ``SwinDetDataPreprocessor`` / ``SwinSegDataPreProcessor``
                carries its images' sizes (:mod:`swin_backbone.mmlab.valid_sizes`); they
                are used when ``valid_sizes`` is not given.
        """
        check_input(x, self.in_channels, self.patch_embed.proj.weight)
        if valid_sizes is None and not is_compiling():
            valid_sizes = self._attached_sizes(x)
        valid = check_valid_sizes(
            valid_sizes, x.shape, mask_padding=self.mask_padding, pad_small_map=self.pad_small_map
        )
        plan = ops.plan_forward(
            x, self, attn_dropout=self.training and self.attn_drop_rate > 0,
            dropout=self.training and self.drop_rate > 0, drop_path=self.training and self.drop_path_rate > 0,
            valid_sizes=valid, attention=self.attention_mode,
        )
        x = self.patch_embed(ops.mask_input(x, plan, self.patch_size))  # (B, H0, W0, C)
        if self.absolute_pos_embed is not None:
            x = x + self._position_embeddings(x.shape[1], x.shape[2], plan)
        x = self.drop_after_pos(x)
        outs = []
        last = self.out_indices[-1]
        for i in range(last + 1):
            stage = self.stages[i]
            stage_plan = plan.for_stage(x, stage, i)
            out = stage(x, stage_plan)
            if i in self.out_indices:
                outs.append(ops.output_nchw(out, getattr(self, f"norm{i}"), self.channels_last_outputs, stage_plan))
            if i < last:
                x = stage.downsample(out, stage_plan)
        ops.finish_forward(plan)
        return tuple(outs)

    @property
    def attention_mode(self) -> str:
        """The ``attention`` setting in force (``SWIN_BACKBONE_ATTENTION`` overrides it)."""
        return ops.check_attention(self.attention)

    def _attached_sizes(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Sizes a ``Swin*DataPreprocessor`` attached to ``x``, unless this backbone reproduces
        the libraries' padding semantics (``mask_padding=False`` / ``pad_small_map=False``):
        then padding is ordinary tokens, as the user asked, and the sizes are ignored (said once)."""
        sizes = attached_valid_sizes(x)
        if sizes is None or (self.mask_padding and self.pad_small_map):
            return sizes
        if not getattr(self, "_said_sizes_ignored", False):
            self._said_sizes_ignored = True
            print_log(
                "SwinBackbone: the image sizes attached by the data preprocessor are ignored because "
                f"mask_padding={self.mask_padding}, pad_small_map={self.pad_small_map} reproduce mmdet / mmseg, "
                "where batch padding is attended to (image-exact features need both True)",
                logger="current", level=logging.WARNING,
            )
        return None

    def _position_embeddings(self, height: int, width: int, plan: ops.Plan) -> torch.Tensor:
        """The absolute position embedding for a ``height x width`` token map: ``(1, H, W, C)``,
        or with per-image valid sizes ``(B, H, W, C)``, each image's resized to its own
        token size (as it is alone) at the top left, zeros beyond."""
        stage0 = None if plan.stage_valid_sizes is None else plan.stage_valid_sizes[0]
        if stage0 is None:
            return self.position_embedding(height, width)
        resized = {size: self.position_embedding(*size)[0] for size in set(stage0)}
        return torch.stack([F.pad(resized[(h, w)], (0, 0, 0, width - w, 0, height - h)) for h, w in stage0])
