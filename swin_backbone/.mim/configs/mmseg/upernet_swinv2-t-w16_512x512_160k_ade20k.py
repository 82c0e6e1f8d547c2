# UPerNet, SwinV2-T (window 16, the published window-16 weights), ADE20K 512x512, 160k.
_base_ = ['./upernet_swin-t_512x512_160k_ade20k.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_t_w16_seg}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
