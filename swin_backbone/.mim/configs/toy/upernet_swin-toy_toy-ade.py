# UPerNet with a small Swin on the generated toy ADE20K (tools/make_toy_data.py), from
# scratch on CPU. Data root: $TOY_DATA_ROOT (default ./data) / toy_ade.
_base_ = '../mmseg/upernet_swin-t_512x512_160k_ade20k.py'

data_root = '{{$TOY_DATA_ROOT:data}}/toy_ade/ADEChallengeData2016'
classes = ('background', 'square', 'disc', 'triangle')
metainfo = dict(classes=classes, palette=[[120, 120, 120], [220, 20, 60], [0, 160, 60], [30, 60, 220]])
crop_size = (128, 128)
img_scale = (256, 160)

model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(
        arch=None,
        embed_dims=32,
        depths=(2, 2, 2, 2),
        num_heads=(1, 2, 4, 8),
        drop_path_rate=0.1,
        init_cfg=None),
    decode_head=dict(in_channels=[32, 64, 128, 256], channels=64, num_classes=len(classes)),
    auxiliary_head=dict(in_channels=128, channels=32, num_classes=len(classes)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=img_scale, ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs')
]
# `_scope_='mmseg'`: a type dict this file defines whole (not merged into one of the base's)
# names its library, so that it still builds from mmseg's registries when this config is
# inherited as `swin_backbone::...` (mmengine gives such dicts the scope `swin_backbone`).
dataset = dict(
    _scope_='mmseg',
    type='BaseSegDataset',
    data_root=data_root,
    metainfo=metainfo,
    img_suffix='.jpg',
    seg_map_suffix='.png',
    reduce_zero_label=True)
loader = dict(num_workers=2, persistent_workers=True)
train_dataloader = dict(
    **loader,
    batch_size=4,
    dataset=dict(
        _delete_=True,
        **dataset,
        data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'),
        pipeline=train_pipeline))
val_dataloader = dict(
    **loader,
    batch_size=1,
    dataset=dict(
        _delete_=True,
        **dataset,
        data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader

max_iters = 400
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
optim_wrapper = dict(optimizer=dict(lr=6e-4))
param_scheduler = [
    dict(_scope_='mmseg', type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=30),
    dict(_scope_='mmseg', type='PolyLR', eta_min=0.0, power=1.0, begin=30, end=max_iters, by_epoch=False)
]
default_hooks = dict(
    logger=dict(interval=20),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=2))
