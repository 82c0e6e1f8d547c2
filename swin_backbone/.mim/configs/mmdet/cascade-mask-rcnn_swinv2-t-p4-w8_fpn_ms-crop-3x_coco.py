# Cascade Mask R-CNN + FPN, SwinV2-T (window 8), 3x multi-scale + crop: the Swin paper's
# cascade recipe with the V2 backbone.
_base_ = ['./cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_t}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
