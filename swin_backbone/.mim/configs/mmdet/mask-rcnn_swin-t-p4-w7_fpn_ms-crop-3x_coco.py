# Mask R-CNN + FPN, Swin-T, 3x schedule with multi-scale + crop augmentation (mmdet zoo:
# box 46.0 / mask 41.6 AP). AdamW lr 1e-4, wd 0.05, no decay on norms / position tables.
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/swin_backbone.py']

# data_preprocessor: the library's preprocessor that also hands each image's size to the
# backbone, so features do not depend on batch padding (README: image-exact batches).
model = dict(
    data_preprocessor=dict(type='SwinDetDataPreprocessor'),
    backbone={{_base_.swin_t}}, neck=dict(in_channels=[96, 192, 384, 768]))
