# Semantic FPN, Swin-T, ADE20K 512x512, 160k; the Swin recipe's AdamW settings.
_base_ = ['mmseg::sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py', '../_base_/swin_backbone.py']

model = dict(pretrained=None, backbone={{_base_.swin_t_seg}}, neck=dict(in_channels=[96, 192, 384, 768]))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.0001, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg={{_base_.swin_paramwise_cfg}})
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False)
]
