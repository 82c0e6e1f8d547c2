# Shared pieces of the SwinV2Backbone configs: the SwinV2 backbones (local pretrained files,
# never a URL) and the no-decay keys. Swin V2's official recipe (`no_weight_decay_keywords`)
# adds the continuous-position-bias MLPs and the cosine attention's logit scales to V1's norms
# and position tables. Configs list this file beside a V1 config of this package, which brings
# the plugin import (`custom_imports`) and the data / schedule.

# SwinV2-T, window 8, ImageNet-1k 256x256 weights (official / timm `swinv2_tiny_window8_256`;
# every V2 format loads: official, timm, torchvision, mmpretrain).
swinv2_t = dict(
    _delete_=True,  # replaces the base config's backbone entirely
    type='SwinV2Backbone',
    arch='tiny',
    window_size=8,
    pretrained_window_sizes=0,
    drop_path_rate=0.2,
    out_indices=(0, 1, 2, 3),
    with_cp=False,
    # Image-exact batches (each image's features as alone, docs/image-exact-batches.md) need
    # mmdet's small-map rule; SwinV2Backbone's default is Swin V2's own (the checkpoint model's
    # features at its pretraining size), which differs only where a map is not larger than the window.
    pad_small_map=True,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swinv2_tiny_patch4_window8_256.pth'))

swinv2_paramwise_cfg = dict(
    custom_keys={
        'absolute_pos_embed': dict(decay_mult=0.),
        'relative_position_bias_table': dict(decay_mult=0.),
        'cpb_mlp': dict(decay_mult=0.),
        'logit_scale': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)
    })

# Window 16: the published `swinv2_*_window16_256` weights (trained at window 16, so the
# position bias is normalised by 16: pretrained_window_sizes=0). Fine-tuning window-8 weights at
# window 16 instead: pretrained_window_sizes=8.
swinv2_t_w16 = dict(swinv2_t, window_size=16,
                    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swinv2_tiny_patch4_window16_256.pth'))
swinv2_s = dict(swinv2_t, arch='small', drop_path_rate=0.3,
                init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swinv2_small_patch4_window8_256.pth'))
swinv2_s_w16 = dict(swinv2_s, window_size=16,
                    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swinv2_small_patch4_window16_256.pth'))
# SwinV2-B window 16 from the ImageNet-22k window-12 (192x192) weights, as published
# (`swinv2_base_window12to16_192to256`: stage 4 was pre-trained at window 6).
swinv2_b_w16 = dict(swinv2_t, arch='base', window_size=16, pretrained_window_sizes=(12, 12, 12, 6),
                    drop_path_rate=0.3,
                    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swinv2_base_patch4_window12_192_22k.pth'))
swinv2_t_seg = dict(swinv2_t, drop_path_rate=0.3)  # the segmentation recipe
swinv2_t_w16_seg = dict(swinv2_t_w16, drop_path_rate=0.3)
