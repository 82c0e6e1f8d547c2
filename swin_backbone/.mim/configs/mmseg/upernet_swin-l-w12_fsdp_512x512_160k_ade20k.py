# UPerNet, Swin-L (window 12, ImageNet-22k 384x384 weights), ADE20K 512x512, 160k, on
# mmengine's FlexibleRunner with FSDP (configs/_base_/fsdp.py; docs/large-models.md): one FSDP
# unit per Swin block, original parameters, bf16 autocast, activation checkpointing per block,
# one checkpoint file per save (gathered on rank 0). The recipe of ./upernet_swin-t_512x512_160k_ade20k.py (8 GPUs x 2
# images, AdamW lr 6e-5, no decay on norms / position tables) with the large backbone.
#
#   bash tools/dist_train.sh configs/mmseg/upernet_swin-l-w12_fsdp_512x512_160k_ade20k.py 8
_base_ = ['./upernet_swin-t_512x512_160k_ade20k.py', '../_base_/fsdp.py']

model = dict(
    backbone={{_base_.swin_l}},
    decode_head=dict(in_channels={{_base_.swin_l_channels}}),
    auxiliary_head=dict(in_channels=768))
# bf16 autocast without a loss scaler (V100: type='AmpOptimWrapper', dtype='float16')
optim_wrapper = dict(type='swin_backbone.mmlab.optim.BF16AutocastOptimWrapper')
default_hooks = dict(checkpoint=dict(max_keep_ckpts=3))
