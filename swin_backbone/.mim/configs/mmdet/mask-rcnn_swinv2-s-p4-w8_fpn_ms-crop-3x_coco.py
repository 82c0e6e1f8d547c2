# Mask R-CNN + FPN, SwinV2-S (window 8), 3x multi-scale + crop.
_base_ = ['./mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_s}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
