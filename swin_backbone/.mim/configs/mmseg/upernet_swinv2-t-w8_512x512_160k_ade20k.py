# UPerNet, SwinV2-T (window 8), ADE20K 512x512, 160k iterations: the Swin-T recipe
# (AdamW lr 6e-5, wd 0.01, drop_path 0.3) with V2's no-decay keys.
_base_ = ['./upernet_swin-t_512x512_160k_ade20k.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_t_seg}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
