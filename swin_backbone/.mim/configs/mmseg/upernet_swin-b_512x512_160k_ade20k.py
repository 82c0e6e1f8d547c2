# UPerNet, Swin-B, ADE20K 512x512, 160k (published mIoU 48.1 single scale, IN-1k weights).
_base_ = './upernet_swin-t_512x512_160k_ade20k.py'

pretrained = 'checkpoints/swin_base_patch4_window7_224.pth'  # noqa
model = dict(
    backbone=dict(arch='base', init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(in_channels=[128, 256, 512, 1024]),
    auxiliary_head=dict(in_channels=512))
