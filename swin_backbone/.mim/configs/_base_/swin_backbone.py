# Shared pieces of the SwinBackbone configs: the plugin import, the Swin-T backbone (local
# pretrained file, never a URL) and the Swin recipe's no-decay keys. Configs list this file
# in `_base_` beside the mmdet:: / mmseg:: base and use `{{_base_.swin_t}}`.
custom_imports = dict(imports=['swin_backbone'], allow_failed_imports=False)

swin_t = dict(
    _delete_=True,  # replaces the base config's backbone entirely
    type='SwinBackbone',
    arch='tiny',
    window_size=7,
    drop_path_rate=0.2,
    out_indices=(0, 1, 2, 3),
    with_cp=False,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swin_tiny_patch4_window7_224.pth'))

swin_paramwise_cfg = dict(
    custom_keys={
        'absolute_pos_embed': dict(decay_mult=0.),
        'relative_position_bias_table': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)
    })

# Variants used by the shipped configs (the base file is plain Python, so derive, don't copy).
swin_t_seg = dict(swin_t, drop_path_rate=0.3)  # the segmentation recipe
swin_t_c345 = dict(swin_t, out_indices=(1, 2, 3))  # RetinaNet: stages 1-3 only
