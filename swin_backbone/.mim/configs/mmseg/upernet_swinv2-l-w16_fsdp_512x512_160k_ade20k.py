# UPerNet, SwinV2-L (window 16 from the ImageNet-22k window-12 weights:
# pretrained_window_sizes=(12, 12, 12, 6)), ADE20K 512x512, 160k, on FlexibleRunner with FSDP:
# the Swin-L FSDP recipe (./upernet_swin-l-w12_fsdp_512x512_160k_ade20k.py) with the V2
# backbone and V2's no-decay keys.
_base_ = ['./upernet_swin-l-w12_fsdp_512x512_160k_ade20k.py', '../_base_/swinv2_backbone.py']

model = dict(backbone={{_base_.swinv2_l}})
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
