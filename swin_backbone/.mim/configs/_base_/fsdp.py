# Past one GPU: mmengine's FlexibleRunner with FSDPStrategy for the large Swin backbones
# (docs/large-models.md). Configs list this file in `_base_` after their detector / segmentor
# config; it sets the runner, the strategy and the large backbones' settings.
#
# * one FSDP unit per Swin block (SwinBlock / SwinBlockV2, exported by swin_backbone for this
#   policy); the rest of the model (patch embedding, patch merging, norms, neck, heads) is the
#   root unit;
# * use_orig_params=True: the optimizer sees the model's own parameters, so paramwise_cfg
#   (no decay on norms / position tables, per-stage lr_mult), frozen stages (requires_grad=False
#   inside a unit) and the schedulers work as under DDP;
# * sharded checkpoints: state_dict_cfg='local' saves iter_N.pth/ as one rankK.pth per rank
#   (resume with the same number of ranks);
# * activation checkpointing: the backbone's own with_cp (non-reentrant torch checkpoint per
#   block), which composes with the per-block units: the backward re-gathers a block's shards
#   for its recomputation.
# Mixed precision is the optimizer wrapper's autocast (the configs using this base set it):
# FSDP keeps fp32 master shards.
_base_ = []

# ---- Code this recipe needs that neither mmengine 0.10.7 nor torch provide by name. It runs when
# the config is read (every rank reads it) and leaves no names behind (`del` below): a config
# holds only values that print as Python, since mmengine writes it into the work dir. Three things:
# 1. the wrap policy `swin_block_wrap_policy` (one FSDP unit per SwinBlock / SwinBlockV2);
# 2. `SwinFSDPStrategy`: mmengine's FSDPStrategy, except that resuming calls
#    FSDP.optim_state_dict_to_load with keywords (mmengine passes torch 2.0's argument order;
#    torch >= 2.1 takes (model, optim, optim_state_dict), so --resume fails);
# 3. FSDP's ShardedTensor classes allow-listed for torch.load(weights_only=True) (torch >= 2.6;
#    mmengine passes no argument), as swin_backbone does for the rest of a Runner checkpoint.
import torch.distributed._shard.metadata as shard_metadata  # noqa: E402  (after _base_: a plain config)
import torch.distributed._shard.sharded_tensor as sharded  # noqa: E402
import torch.distributed._shard.sharding_spec.chunk_sharding_spec as chunk_spec  # noqa: E402
import torch.distributed.remote_device as remote_device  # noqa: E402
import torch.serialization as serialization  # noqa: E402
from mmengine._strategy import FSDPStrategy  # noqa: E402
from mmengine.registry import FUNCTIONS, STRATEGIES  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: E402
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: E402

import swin_backbone  # noqa: E402


# (what the functions use is bound as default arguments: the `del` below removes the names)
def swin_block_wrap_policy(module, recurse, nonwrapped_numel, policy=transformer_auto_wrap_policy,
                           blocks=(swin_backbone.SwinBlock, swin_backbone.SwinBlockV2)):
    """FSDP auto-wrap policy: one unit per Swin block."""
    return policy(module, recurse, nonwrapped_numel, transformer_layer_cls=set(blocks))


class SwinFSDPStrategy(FSDPStrategy):
    """mmengine's FSDPStrategy, resuming on torch >= 2.1 (see above)."""

    def load_optim_state_dict(self, state_dict, fsdp=FullyShardedDataParallel):
        optimizer = self.optim_wrapper.optimizer
        self.optim_wrapper.load_state_dict(
            fsdp.optim_state_dict_to_load(model=self.model, optim=optimizer, optim_state_dict=state_dict))


FUNCTIONS.register_module(name='swin_block_wrap_policy', module=swin_block_wrap_policy, force=True)
STRATEGIES.register_module(name='SwinFSDPStrategy', module=SwinFSDPStrategy, force=True)
if hasattr(serialization, 'add_safe_globals'):  # torch < 2.4 loads them without
    serialization.add_safe_globals([
        sharded.ShardedTensor, sharded.ShardedTensor.ProcessGroupState, sharded.ShardedTensorMetadata,
        sharded.TensorProperties, sharded.Shard, sharded.metadata.MEM_FORMAT_ENCODING,
        shard_metadata.ShardMetadata, chunk_spec.ChunkShardingSpec, remote_device._remote_device])
del (shard_metadata, sharded, chunk_spec, remote_device, serialization, FSDPStrategy, FUNCTIONS, STRATEGIES,
     FullyShardedDataParallel, transformer_auto_wrap_policy, swin_backbone, swin_block_wrap_policy, SwinFSDPStrategy)
# ---- end of code

runner_type = 'FlexibleRunner'
strategy = dict(
    _scope_='mmengine',  # registered in mmengine's root registry (also when inherited through swin_backbone::)
    type='SwinFSDPStrategy',
    model_wrapper=dict(
        auto_wrap_policy='swin_block_wrap_policy',
        use_orig_params=True,
        sharding_strategy='FULL_SHARD',
        backward_prefetch='BACKWARD_PRE'),
    state_dict_cfg='local')

# Swin-L, window 12, ImageNet-22k 384x384 weights (official swin_large_patch4_window12_384_22k;
# any format loads), drop path 0.3, per-block activation checkpointing.
swin_l = dict(
    _delete_=True,
    type='SwinBackbone',
    arch='large',
    window_size=12,
    pretrain_img_size=384,
    drop_path_rate=0.3,
    out_indices=(0, 1, 2, 3),
    with_cp=True,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swin_large_patch4_window12_384_22k.pth'))
# SwinV2-L, window 16 from the ImageNet-22k window-12 (192x192) weights, as published
# (`swinv2_large_window12to16_192to256`: stage 4 pre-trained at window 6).
swinv2_l = dict(
    _delete_=True,
    type='SwinV2Backbone',
    arch='large',
    window_size=16,
    pretrained_window_sizes=(12, 12, 12, 6),
    drop_path_rate=0.3,
    out_indices=(0, 1, 2, 3),
    with_cp=True,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swinv2_large_patch4_window12_192_22k.pth'))
swin_l_channels = [192, 384, 768, 1536]
