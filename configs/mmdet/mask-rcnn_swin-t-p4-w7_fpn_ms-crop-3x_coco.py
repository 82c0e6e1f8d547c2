# Mask R-CNN + FPN, Swin-T, 3x schedule with multi-scale + crop augmentation (mmdet zoo:
# box 46.0 / mask 41.6 AP). AdamW lr 1e-4, wd 0.05, no decay on norms / position tables.
_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py'
custom_imports = dict(imports=['swin_backbone'], allow_failed_imports=False)

pretrained = 'checkpoints/swin_tiny_patch4_window7_224.pth'  # noqa
model = dict(
    backbone=dict(
        _delete_=True,
        type='SwinBackbone',
        arch='tiny',
        window_size=7,
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[96, 192, 384, 768]))
