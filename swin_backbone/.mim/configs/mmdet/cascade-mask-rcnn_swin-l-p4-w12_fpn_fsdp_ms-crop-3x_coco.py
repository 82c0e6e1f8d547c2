# Cascade Mask R-CNN + FPN, Swin-L (window 12, ImageNet-22k 384x384 weights), 3x multi-scale +
# crop, on mmengine's FlexibleRunner with FSDP (configs/_base_/fsdp.py; docs/large-models.md):
# one FSDP unit per Swin block, original parameters, bf16 autocast, activation checkpointing per
# block, sharded checkpoints. The cascade recipe of ./cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py
# (8 GPUs x 2 images, AdamW lr 1e-4, no decay on norms / position tables) with the large backbone.
#
#   NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 \
#     bash tools/dist_train.sh configs/mmdet/cascade-mask-rcnn_swin-l-p4-w12_fpn_fsdp_ms-crop-3x_coco.py 8
# Weights: a local file (any Swin-L format), e.g.
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/swin_large_patch4_window12_384_22k.pth
_base_ = ['./cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/fsdp.py']

model = dict(backbone={{_base_.swin_l}}, neck=dict(in_channels={{_base_.swin_l_channels}}))
# Mixed precision: bf16 autocast (Ampere and later; V100: dtype='float16'); FSDP keeps fp32
# parameter shards and mmengine gives the wrapper FSDP's sharded loss scaler.
optim_wrapper = dict(type='AmpOptimWrapper', dtype='bfloat16')
# Resume needs the same number of ranks as the run that saved the shards.
default_hooks = dict(checkpoint=dict(max_keep_ckpts=3))
