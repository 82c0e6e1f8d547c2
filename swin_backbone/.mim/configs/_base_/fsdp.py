# Past one GPU: mmengine's FlexibleRunner with FSDPStrategy for the large Swin backbones
# (docs/large-models.md). Configs list this file in `_base_` after their detector / segmentor
# config; it sets the runner, the strategy and the large backbones' settings. Values only: the code
# (strategy, wrap policy) is in swin_backbone/mmlab/fsdp.py, named by dotted path (mmengine imports
# it), so the copy of a config that mmengine writes into the work dir reads again in any process.
#
# * one FSDP unit per Swin block (SwinBlock / SwinBlockV2); the rest of the model (patch embedding,
#   patch merging, norms, neck, heads) is the root unit;
# * use_orig_params=True: the optimizer sees the model's own parameters, so paramwise_cfg
#   (no decay on norms / position tables, per-stage lr_mult), frozen stages (requires_grad=False
#   inside a unit) and the schedulers work as under DDP;
# * SwinFSDPStrategy: clip_grad (type 'norm') clips by the norm of the whole model's gradients
#   (FSDP's clip_grad_norm_ over all ranks), the norm logged is that one;
# * checkpoints: state_dict_cfg='full' saves one file (gathered on rank 0), the layout of a DDP
#   run's checkpoint: tools/test.py, load_from, swin-convert-checkpoint, swin-extract-features and
#   swin_backbone.load_checkpoint read it, and --resume reads it at any world size.
#   state_dict_cfg='local' saves iter_N.pth/rankK.pth (each rank 1/ranks of the state, no gather),
#   which resume and tools/test.py read at the same world size only. load_from of a file works
#   under either;
# * activation checkpointing: the backbone's own with_cp (non-reentrant torch checkpoint per
#   block), which composes with the per-block units: the backward re-gathers a block's shards
#   for its recomputation.
# Mixed precision is bf16 autocast in the optimizer wrapper (the configs using this base set it):
# FSDP keeps fp32 parameter shards and reduces fp32 gradients.
runner_type = 'FlexibleRunner'
strategy = dict(
    _scope_='mmengine',  # built from mmengine's root registry (also when inherited through swin_backbone::)
    type='swin_backbone.mmlab.fsdp.SwinFSDPStrategy',
    model_wrapper=dict(
        auto_wrap_policy='swin_backbone.mmlab.fsdp.swin_block_wrap_policy',
        use_orig_params=True,
        # FULL_SHARD: shard over all ranks. HYBRID_SHARD: shard within a node, replicate across nodes
        # (docs/large-models.md: the inter-node traffic it saves)
        sharding_strategy='FULL_SHARD',
        backward_prefetch='BACKWARD_PRE'),
    state_dict_cfg='full')

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
