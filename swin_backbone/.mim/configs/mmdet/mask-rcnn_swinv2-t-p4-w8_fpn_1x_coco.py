# Mask R-CNN + FPN, SwinV2-T (window 8), 1x schedule on COCO: the Swin-T recipe with the V2
# backbone and V2's no-decay keys (cpb_mlp, logit_scale).
_base_ = ['./mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_t}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
