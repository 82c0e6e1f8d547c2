# UPerNet, SwinV2-B (window 16 from the ImageNet-22k window-12 weights:
# pretrained_window_sizes=(12, 12, 12, 6)), ADE20K 512x512, 160k.
_base_ = ['./upernet_swin-t_512x512_160k_ade20k.py', '../_base_/swinv2_backbone.py']

model = dict(
    backbone={{_base_.swinv2_b_w16}},
    decode_head=dict(in_channels=[128, 256, 512, 1024]),
    auxiliary_head=dict(in_channels=512))
optim_wrapper = dict(paramwise_cfg={{_base_.swinv2_paramwise_cfg}})
