# Mask R-CNN + FPN, Swin-S, 3x multi-scale-crop (mmdet zoo: box 48.5 / mask 43.3 AP).
_base_ = './mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py'

pretrained = 'checkpoints/swin_small_patch4_window7_224.pth'  # noqa
model = dict(
    backbone=dict(
        arch='small',
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)))
