# Cascade Mask R-CNN + FPN, SwinV2-L (window 16 from the ImageNet-22k window-12 weights:
# pretrained_window_sizes=(12, 12, 12, 6)), 3x multi-scale + crop, on FlexibleRunner with FSDP:
# the Swin-L FSDP recipe (./cascade-mask-rcnn_swin-l-p4-w12_fpn_fsdp_ms-crop-3x_coco.py) with the
# V2 backbone and V2's no-decay keys (continuous position bias MLPs, logit scales).
#
_base_ = ['./cascade-mask-rcnn_swin-l-p4-w12_fpn_fsdp_ms-crop-3x_coco.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_l}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
