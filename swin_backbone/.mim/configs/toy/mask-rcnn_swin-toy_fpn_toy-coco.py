# Mask R-CNN + FPN with a small Swin (embed 48, depths 2-2-2-2) on the generated toy COCO
# (tools/make_toy_data.py), trained from scratch on CPU in minutes. Used by `make demo` and
# the tests. Data root: $TOY_DATA_ROOT (default ./data) / toy_coco.
_base_ = '../mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'

data_root = '{{$TOY_DATA_ROOT:data}}/toy_coco/'
classes = ('square', 'disc', 'triangle')
metainfo = dict(classes=classes, palette=[(220, 20, 60), (0, 160, 60), (30, 60, 220)])
img_scale = (192, 192)
neck_channels = 96

model = dict(
    data_preprocessor=dict(pad_size_divisor=32),
    backbone=dict(
        arch=None,
        embed_dims=48,
        depths=(2, 2, 2, 2),
        num_heads=(2, 4, 8, 16),
        drop_path_rate=0.1,
        init_cfg=None),
    neck=dict(in_channels=[48, 96, 192, 384], out_channels=neck_channels),
    rpn_head=dict(in_channels=neck_channels, feat_channels=neck_channels),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=neck_channels),
        bbox_head=dict(in_channels=neck_channels, fc_out_channels=256, num_classes=len(classes)),
        mask_roi_extractor=dict(out_channels=neck_channels),
        mask_head=dict(in_channels=neck_channels, conv_out_channels=neck_channels, num_classes=len(classes))),
    train_cfg=dict(
        rpn=dict(sampler=dict(num=64)),
        rpn_proposal=dict(nms_pre=500, max_per_img=200),
        rcnn=dict(sampler=dict(num=64))),
    test_cfg=dict(rpn=dict(nms_pre=500, max_per_img=100), rcnn=dict(max_per_img=20)))

backend_args = None
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
loader = dict(batch_size=4, num_workers=2, persistent_workers=True)
train_dataloader = dict(
    **loader,
    sampler=dict(type='InfiniteSampler'),  # iteration-based training: no epoch restarts
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        pipeline=train_pipeline))
val_dataloader = dict(
    **loader,
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json', metric=['bbox', 'segm'])
test_evaluator = val_evaluator

max_iters = 300
# `_scope_='mmdet'`: a type dict this file defines whole (not merged into one of the base's)
# names its library, so that it still builds from mmdet's registries when this config is
# inherited as `swin_backbone::...` (mmengine gives such dicts the scope `swin_backbone`).
train_cfg = dict(_delete_=True, _scope_='mmdet', type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(_scope_='mmdet', type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(_scope_='mmdet', type='CosineAnnealingLR', by_epoch=False, begin=50, end=max_iters, eta_min=1e-5)
]
optim_wrapper = dict(optimizer=dict(lr=4e-4), clip_grad=dict(max_norm=10.0))
default_hooks = dict(
    logger=dict(interval=20),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=2))
log_processor = dict(by_epoch=False)
auto_scale_lr = dict(enable=False, base_batch_size=4)
