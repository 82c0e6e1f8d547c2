# UPerNet, SwinV2-S (window 16), ADE20K 512x512, 160k.
_base_ = ['./upernet_swin-t_512x512_160k_ade20k.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_s_w16}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
