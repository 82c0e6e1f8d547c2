# Semantic FPN, Swin-T, ADE20K 512x512, 160k; the Swin recipe's AdamW settings.
_base_ = ['mmseg::sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py', '../_base_/swin_backbone.py']

# data_preprocessor: the library's preprocessor that also hands each image's size to the
# backbone, so features do not depend on batch padding (README: image-exact batches).
model = dict(
    data_preprocessor=dict(type='SwinSegDataPreProcessor'),
    pretrained=None, backbone={{_base_.swin_t_seg}}, neck=dict(in_channels=[96, 192, 384, 768]))

# `_scope_='mmseg'`: a type dict this file defines whole (not merged into one of the base's)
# names its library, so that it still builds from mmseg's registries when this config is
# inherited as `swin_backbone::...` (mmengine gives such dicts the scope `swin_backbone`).
optim_wrapper = dict(
    _delete_=True,
    _scope_='mmseg',
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.0001, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg={{_base_.swin_paramwise_cfg}})
param_scheduler = [
    dict(_scope_='mmseg', type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(_scope_='mmseg', type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False)
]
