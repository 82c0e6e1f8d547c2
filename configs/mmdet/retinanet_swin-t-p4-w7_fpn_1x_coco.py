# RetinaNet + FPN, Swin-T, 1x. Only stages 1-3 feed the FPN (out_indices=(1, 2, 3),
# start_level=0); stage 0 still runs, its output norm is not built.
_base_ = 'mmdet::swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py'
custom_imports = dict(imports=['swin_backbone'], allow_failed_imports=False)

pretrained = 'checkpoints/swin_tiny_patch4_window7_224.pth'  # noqa
model = dict(
    backbone=dict(
        _delete_=True,
        type='SwinBackbone',
        arch='tiny',
        window_size=7,
        drop_path_rate=0.2,
        out_indices=(1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[192, 384, 768], start_level=0, num_outs=5))

# The Swin recipe: AdamW, no weight decay on norms and position tables.
optim_wrapper = dict(
    type='OptimWrapper',
    paramwise_cfg=dict(
        custom_keys={
            'absolute_pos_embed': dict(decay_mult=0.),
            'relative_position_bias_table': dict(decay_mult=0.),
            'norm': dict(decay_mult=0.)
        }),
    optimizer=dict(
        _delete_=True,
        type='AdamW',
        lr=0.0001,
        betas=(0.9, 0.999),
        weight_decay=0.05))
