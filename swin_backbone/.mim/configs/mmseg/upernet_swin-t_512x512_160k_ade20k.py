# UPerNet, Swin-T, ADE20K 512x512, 160k iterations (published mIoU 44.5 single scale /
# 45.8 multi-scale). Inherits mmseg's own config; only the backbone changes.
# AdamW lr 6e-5, wd 0.01, no decay on norms / position tables, drop_path 0.3.
_base_ = [
    'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/swin_backbone.py'
]

# data_preprocessor: the library's preprocessor that also hands each image's size to the
# backbone, so features do not depend on batch padding (README: image-exact batches).
model = dict(
    data_preprocessor=dict(type='SwinSegDataPreProcessor'),
    pretrained=None,
    backbone={{_base_.swin_t_seg}},
    decode_head=dict(in_channels=[96, 192, 384, 768], num_classes=150),
    auxiliary_head=dict(in_channels=384, num_classes=150))
