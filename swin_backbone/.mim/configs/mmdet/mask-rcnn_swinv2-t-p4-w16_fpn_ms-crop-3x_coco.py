# Mask R-CNN + FPN, SwinV2-T (window 16, the published window-16 weights), 3x multi-scale + crop.
_base_ = ['./mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_t_w16}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
