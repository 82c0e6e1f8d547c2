# Mask R-CNN + FPN, Swin-T backbone, 1x schedule on COCO (mmdet zoo: box 42.7 / mask 39.3 AP
# with ImageNet-1k weights). Inherits mmdet's own config; only the backbone changes.
# Pretrained weights are a local file (any format: official, mmdet, timm, torchvision):
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/swin_tiny_patch4_window7_224.pth
_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
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
