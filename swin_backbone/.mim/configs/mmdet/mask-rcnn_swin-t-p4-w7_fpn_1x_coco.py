# Mask R-CNN + FPN, Swin-T backbone, 1x schedule on COCO (mmdet zoo: box 42.7 / mask 39.3 AP
# with ImageNet-1k weights). Inherits mmdet's own config; only the backbone changes.
# Pretrained weights are a local file (any format: official, mmdet, timm, torchvision):
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/swin_tiny_patch4_window7_224.pth
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', '../_base_/swin_backbone.py']

# data_preprocessor: the library's preprocessor that also hands each image's size to the
# backbone, so features do not depend on batch padding (README: image-exact batches).
model = dict(
    data_preprocessor=dict(type='SwinDetDataPreprocessor'),
    backbone={{_base_.swin_t}}, neck=dict(in_channels=[96, 192, 384, 768]))
