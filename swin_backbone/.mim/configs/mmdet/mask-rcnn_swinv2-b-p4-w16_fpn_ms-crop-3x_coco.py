# Mask R-CNN + FPN, SwinV2-B (window 16 from the ImageNet-22k window-12 weights:
# pretrained_window_sizes=(12, 12, 12, 6)), 3x multi-scale + crop.
_base_ = ['./mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_b_w16}}, neck=dict(in_channels=[128, 256, 512, 1024]))
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
