"""SwinBackbone: the multi-scale Swin Transformer backbone for detection and segmentation."""
from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmengine.model.weight_init import initialize, trunc_normal_
from torch import nn

from .. import ops
from ..torch_compat import is_compiling, register_load_state_dict_pre_hook, run_eagerly
from ..validation import check_compile, check_config, check_flag, check_input, check_valid_sizes
from .blocks import PatchEmbed, PatchMerging, SwinBlock, SwinStage
from .compiled import compile_backbone
from .dropin import InitCfg, translate_mmlab_args
from .presets import resolve_arch
from .valid_sizes import ATTRIBUTE as SIZES_ATTRIBUTE, read_valid_sizes

# The checkpoint package sits above the model and plugs into it when imported:
#: ``load_state_dict`` pre-hooks every backbone gets (the checkpoint key converter);
LOAD_STATE_DICT_PRE_HOOKS: List[Callable[..., None]] = []
#: the mmengine ``WEIGHT_INITIALIZERS`` entry that runs ``init_cfg=dict(type='Pretrained', ...)``.
PRETRAINED_INIT = "SwinBackbonePretrained"


#: What the first compiled forward logs, by device type ('': any other). The figures are in
#: docs/performance.md, not here.
COMPILE_NOTES = {
    "cuda": "measured faster than eager on CUDA, behind compiled mmdet, after minutes of compiling per kind of "
            "forward; for one input size compile=dict(mode='reduce-overhead', dynamic=False, regions=False) is the "
            "fastest mode measured (docs/performance.md, \"GPU\")",
    "cpu": "measured slower than eager on the CPU (compile=False is faster)",
    "": "not measured on this device",
}
#: What building a backbone compiled whole logs (its forward is traced: no log line there).
COMPILE_WHOLE_NOTE = ("the whole backbone is compiled, once per input size with dynamic=False; with "
                      "mode='reduce-overhead' (CUDA graphs) the fastest mode measured for fixed-size inputs "
                      "(docs/performance.md, \"GPU\"); per-image valid sizes are a tensor input of the same "
                      "graph (docs/shape-buckets.md)")


class SwinBackbone(BaseModule):
    """Swin Transformer backbone emitting stage 1-4 feature maps, correct at any input size.

    docs/arguments.md documents every argument for users (the mmdet / mmseg ones under
    "Switching from mmdet / mmseg"); in short:

    Args:
        arch: ``'tiny'``, ``'small'``, ``'base'``, ``'large'`` (or ``'t'``/``'s'``/``'b'``/``'l'``);
            ``embed_dims`` / ``depths`` / ``num_heads`` given explicitly override it.
        embed_dims: channels ``C`` of stage 0; stage ``i`` has ``C * 2**i``.
        depths, num_heads: blocks and attention heads per stage.
        patch_size: patch-embedding stride (= kernel): ``P`` or ``(P, P)``.
        window_size: attention window (7; 12 for the 384-pretrained models), or one per stage.
        qk_scale: query scale; ``None`` means ``head_dim ** -0.5``.
        drop_rate: dropout after position embedding, attention projection and MLP.
        drop_path_rate: stochastic depth, rising linearly from 0 over all blocks.
        use_abs_pos_embed: a learned absolute position embedding, stored at the
            ``pretrain_img_size / patch_size`` grid (``S``, ``(S,)`` or ``(H, W)``) and resized
            (bicubic) to each input.
        patch_norm: LayerNorm after patch embedding and inside patch merging.
        out_indices: stages returned, each after its own LayerNorm. Later stages are built (so
            checkpoints load) but never run: ``requires_grad=False``, as DDP needs a gradient for
            every trainable parameter.
        frozen_stages: ``k >= 0`` freezes the patch embedding (and absolute position embedding)
            and stages ``0 .. k-1`` with their norms: ``requires_grad=False`` at construction,
            eval mode kept in ``train()``.
        with_cp: non-reentrant activation checkpointing per block.
        pad_small_map: ``True`` (= mmdet): maps smaller than the window are padded up to it and
            shifted; ``False`` (= the official classifier): the window shrinks to a map side
            <= the window and the shift is off.
        mask_padding: ``True``: window padding is its own attention region, so features do not
            depend on padding; ``False`` reproduces mmdet exactly.
        channels_last_outputs: ``True``: outputs are NCHW *views* of channels-last tokens (one
            copy less each); ``False``: contiguous NCHW (mmcv's CPU RoIAlign misreads channels-last).
        attention: the window-attention kernel: ``'auto'`` (= ``'sdpa'``) or ``'sdpa'``;
            ``SWIN_BACKBONE_ATTENTION`` overrides it.
        strides, act_cfg, norm_cfg, pretrained, convert_weights: mmdet 3.x / mmseg 1.x
            ``SwinTransformer`` arguments, meaning what they mean there
            (:mod:`swin_backbone.model.dropin`); values this backbone cannot honour are a
            ``ValueError`` naming the argument, and ``convert_weights`` has no effect.
        init_cfg: mmengine init config; ``dict(type='Pretrained', checkpoint=PATH)`` loads any
            supported Swin checkpoint format through :func:`swin_backbone.load_checkpoint`.
        block, merging, block_options: variants (as torchvision's ``block=``; see
            :class:`~swin_backbone.SwinV2Backbone`): the block and patch-merging classes, taking the
            arguments of :class:`~swin_backbone.model.blocks.SwinBlock` / ``PatchMerging``, and
            per stage, per block extra keyword arguments for ``block``.
        compile: ``True`` or a dict of ``torch.compile`` options (``mode``, ``backend``,
            ``fullgraph``, ...; ``dynamic`` defaults to ``True``): the blocks, patch embedding,
            mergings and output norms are compiled (regional compilation,
            docs/compiled-mode.md); ``False`` (the default): eager. ``regions=False`` in the
            dict compiles the whole backbone instead (:meth:`forward_static`: one graph per input
            shape, per-image ``valid_sizes`` a tensor input of it); with ``mode='reduce-overhead',
            dynamic=False`` (CUDA graphs) the fastest measured, for fixed-size inputs such as
            segmentation crops or shape buckets (docs/shape-buckets.md).
            Measured faster than eager on CUDA, slower on the CPU (docs/performance.md; a log
            line says which, by device).
        save_memory: in training, keep no LayerNorm or GELU output for backward (backward rebuilds
            them from their inputs: pointwise, no matmul, every module run once). ``None`` (the
            default): on the CPU only (docs/performance.md: the memory it saves, the time); ``True``: on every device
            (on CUDA it saves memory for time per step: docs/performance.md, "GPU"); ``False``:
            never.

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
        compile: Union[bool, Mapping[str, Any]] = False,
        save_memory: Optional[bool] = None,
    ) -> None:
        values, _ = resolve_arch(arch, 1, embed_dims=embed_dims, depths=depths, num_heads=num_heads)
        embed_dims, depths, num_heads = values["embed_dims"], values["depths"], values["num_heads"]
        # mmdet / mmseg SwinTransformer argument forms -> ours (ValueError where impossible)
        mmlab = translate_mmlab_args(
            num_stages=len(depths), patch_size=patch_size, strides=strides, pretrain_img_size=pretrain_img_size,
            act_cfg=act_cfg, norm_cfg=norm_cfg, pretrained=pretrained, init_cfg=init_cfg,
        )
        super().__init__(init_cfg=mmlab.init_cfg)
        patch_size, pretrain_img_size = mmlab.patch_size, mmlab.pretrain_img_size
        out_indices = tuple(out_indices) if isinstance(out_indices, (list, tuple)) else out_indices
        windows = check_config(
            embed_dims=embed_dims, depths=depths, num_heads=num_heads, in_channels=in_channels, patch_size=patch_size,
            window_size=window_size, mlp_ratio=mlp_ratio, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate, pretrain_img_size=pretrain_img_size, out_indices=out_indices,
            frozen_stages=frozen_stages, qk_scale=qk_scale,
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
        #: the ``attention`` setting in force: ``SWIN_BACKBONE_ATTENTION`` (read here, once) or the argument
        self.attention = ops.resolve_attention(attention)
        self.num_stages = len(depths)
        #: ``torch.compile`` options of the compiled regions, ``None``: eager (``compile=False``)
        self.compile_options = check_compile(compile)
        #: its regions compiled (``compile``, not ``regions=False``); a forward on CUDA marks one step of
        #: their CUDA graphs (set where they are compiled: :func:`~swin_backbone.model.compiled.compile_backbone`)
        self.regions_compiled = self.marks_cuda_graph_steps = False
        #: ``compile=dict(regions=False)``: :meth:`forward_static` compiled (called with the backbone first)
        self.whole_graph: Optional[Callable[..., Tuple[torch.Tensor, ...]]] = None
        self._warned_compile = False
        #: training keeps no LayerNorm / GELU output for backward (``ops.LEAN_SAVES``); ``None``: on the CPU only
        if save_memory is not None:
            check_flag("save_memory", save_memory)
        self.save_memory = None if save_memory is None else bool(save_memory)
        self.num_features = tuple(embed_dims * 2**i for i in range(self.num_stages))

        self.patch_embed = PatchEmbed(in_channels, embed_dims, patch_size, norm=patch_norm)
        if use_abs_pos_embed:
            grid = (pretrain_img_size[0] // patch_size, pretrain_img_size[1] // patch_size)
            self.absolute_pos_embed = nn.Parameter(torch.zeros(1, embed_dims, *grid))
        else:
            self.absolute_pos_embed = None
        self.drop_after_pos = nn.Dropout(drop_rate)

        # (in Python, not torch.linspace: a constructor under a meta-device context reads no tensor)
        blocks = sum(depths)
        rates = [drop_path_rate * i / max(blocks - 1, 1) for i in range(blocks)]
        self.stages = nn.ModuleList()
        for i, depth in enumerate(depths):
            first = sum(depths[:i])
            self.stages.append(SwinStage(
                self.num_features[i], depth, num_heads[i], drop_path_rates=rates[first : first + depth],
                downsample=i < self.num_stages - 1, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale,
                drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, patch_norm=patch_norm,
                pad_small_map=pad_small_map, mask_padding=mask_padding, with_cp=with_cp, window_size=windows[i],
                block=block, merging=merging, block_options=None if block_options is None else block_options[i],
            ))
        for i in self.out_indices:
            self.add_module(f"norm{i}", nn.LayerNorm(self.num_features[i]))

        if convert_weights:
            print_log("SwinBackbone: convert_weights is not needed; checkpoint formats are detected automatically.",
                      logger="current")
        if self.compile_options is not None:
            compile_backbone(self, self.compile_options)
            if not self.regions_compiled:
                print_log(f"SwinBackbone: compile=dict(regions=False): {COMPILE_WHOLE_NOTE} (docs/compiled-mode.md)",
                          logger="current")
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
            valid_sizes: per image, the ``(h, w)`` in input pixels that is the image (``B`` pairs
                or a ``(B, 2)`` int tensor); ``None``: the sizes a ``Swin*DataPreprocessor`` attached
                (:mod:`swin_backbone.model.valid_sizes`), else the whole input. Beyond them is
                treated like window padding at every stage and the maps returned are zero there, so
                each image's features equal those of the image run alone (needs
                ``mask_padding=True`` and ``pad_small_map=True``; docs/image-exact-batches.md).
        """
        check_input(x, self.in_channels, self.patch_embed.proj.weight)
        if valid_sizes is None and (x._base is not None or hasattr(x, SIZES_ATTRIBUTE)):  # (a batch, or a crop of one)
            valid_sizes = read_valid_sizes(x, self)
        valid = None if valid_sizes is None else check_valid_sizes(
            valid_sizes, x.shape, mask_padding=self.mask_padding, pad_small_map=self.pad_small_map)
        whole = self.whole_graph is not None and not is_compiling()
        if whole and (valid is None or self.absolute_pos_embed is None):  # (compile=dict(regions=False))
            if self.marks_cuda_graph_steps and x.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()  # one forward, one step of its CUDA graphs
            return self.whole_graph(self, x, None if valid is None else ops.sizes_tensor(valid, x.device))
        if valid is not None and is_compiling():  # (compiled by its user) per-image valid sizes run eagerly
            return run_eagerly(self.forward)(x, valid_sizes)
        compiled = self.regions_compiled
        if compiled and not self._warned_compile:
            self._warned_compile = True
            note = COMPILE_NOTES.get(x.device.type, COMPILE_NOTES[""])
            print_log(f"SwinBackbone: compile=True on {x.device.type}: {note} (docs/compiled-mode.md)", logger="current")
        if self.marks_cuda_graph_steps and x.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()  # one forward, one step of its regions' CUDA graphs
        plans = ops.plan_stages(x, self, compiled_blocks=compiled)  # how each stage runs
        if valid is None:
            return self._stages(x, plans)
        x = ops.mask_input(x, valid, self.patch_size)  # images in a padded batch: patches across their edges read zeros
        return self._stages(x, plans, ops.stage_valid_sizes(valid, self.patch_size, self.num_stages, *x.shape[-2:]))

    def forward_static(self, x: torch.Tensor, sizes: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
        """:meth:`forward` with every shape fixed by ``x``'s, for one graph per input shape
        (``compile=dict(regions=False)`` compiles this; a CUDA graph replays it): the per-image
        valid ``sizes`` (``(B, 2)`` int tensor of input pixels, or ``None``) are a tensor, the
        whole map is computed, and beyond each image is a region of its own in every window, so
        the features are those of :meth:`forward` with ``valid_sizes`` (image-exact).
        ``(B, C_in, H, W)`` -> as :meth:`forward`; no absolute position embedding with ``sizes``."""
        plans = ops.plan_stages(x, self, compiled_blocks=True)  # (traced stage plans: plain torch ops)
        if sizes is None:
            return self._stages(x, plans)
        x = torch.where(ops.valid_map(sizes, x.shape[-2], x.shape[-1]).unsqueeze(1), x, x.new_zeros(()))
        return self._stages(x, plans, ops.stage_sizes(sizes, self.patch_size, self.num_stages))

    def _stages(self, x: torch.Tensor, plans: Sequence[ops.Plan],
                sizes: Optional[Sequence[Union[ops.Sizes, torch.Tensor, None]]] = None) -> Tuple[torch.Tensor, ...]:
        """Patch embedding, stages and output norms of :meth:`forward`; ``plans``: one per stage;
        ``sizes``: per stage the images' token sizes (:data:`~swin_backbone.ops.Sizes`, ``None``
        where they fill the map), or :meth:`forward_static`'s ``(B, 2)`` tensors."""
        static = sizes is not None and isinstance(sizes[0], torch.Tensor)
        x = self.patch_embed(x)  # (B, H0, W0, C)
        if self.absolute_pos_embed is not None:
            x = x + self._position_embeddings(x.shape[1], x.shape[2], None if static or sizes is None else sizes[0])
        x = self.drop_after_pos(x)
        outs = []
        last = self.out_indices[-1]
        for i in range(last + 1):
            stage, plan = self.stages[i], plans[i]
            images = None if sizes is None else sizes[i]
            if static:  # (B, H_i, W_i) bool
                images = ops.valid_map(images, x.shape[1], x.shape[2])
            out = stage(x, plan) if images is None else stage(x, plan, images)
            if i in self.out_indices:
                outs.append(ops.output_nchw(out, getattr(self, f"norm{i}"), self.channels_last_outputs, plan, images))
            if i < last:
                x = stage.downsample(out)
        return tuple(outs)

    def _position_embeddings(self, height: int, width: int, sizes: Optional[ops.Sizes]) -> torch.Tensor:
        """The absolute position embedding for a ``height x width`` token map: ``(1, H, W, C)``,
        or with stage 0's per-image token ``sizes`` ``(B, H, W, C)``, each image's resized to its
        own token size (as it is alone) at the top left, zeros beyond."""
        if sizes is None:
            return self.position_embedding(height, width)
        resized = {size: self.position_embedding(*size)[0] for size in set(sizes)}
        return torch.stack([F.pad(resized[(h, w)], (0, 0, 0, width - w, 0, height - h)) for h, w in sizes])
