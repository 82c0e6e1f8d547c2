# UPerNet, Swin-S, ADE20K 512x512, 160k (published mIoU 47.6 single scale).
_base_ = './upernet_swin-t_512x512_160k_ade20k.py'

pretrained = 'checkpoints/swin_small_patch4_window7_224.pth'  # noqa
model = dict(
    backbone=dict(arch='small', init_cfg=dict(type='Pretrained', checkpoint=pretrained)))
