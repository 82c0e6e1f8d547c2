# Cascade Mask R-CNN + FPN, Swin-L (window 12, ImageNet-22k 384x384 weights), 3x multi-scale +
# crop, on mmengine's FlexibleRunner with FSDP (configs/_base_/fsdp.py; docs/large-models.md):
# one FSDP unit per Swin block, original parameters, bf16 autocast, activation checkpointing per
# block, one checkpoint file per save (gathered on rank 0). The cascade recipe of
# ./cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py (8 GPUs x 2 images, AdamW lr 1e-4, no
# decay on norms / position tables) with the large backbone.
#
#   bash tools/dist_train.sh configs/mmdet/cascade-mask-rcnn_swin-l-p4-w12_fpn_fsdp_ms-crop-3x_coco.py 8
# On 2 machines of 8 GPUs (run on each, NODE_RANK 0 and 1; node0: node 0's address, work dir on a
# shared file system): 16 GPUs x 2 images = a batch of 32, twice the recipe's; the iterations per
# epoch halve and, without --auto-scale-lr, the learning rate stays 1e-4 (mmdet's behaviour):
#   NNODES=2 NODE_RANK=0|1 MASTER_ADDR=node0 MASTER_PORT=29500 \
#     bash tools/dist_train.sh configs/mmdet/cascade-mask-rcnn_swin-l-p4-w12_fpn_fsdp_ms-crop-3x_coco.py 8 \
#     --auto-scale-lr
# Weights: a local file (any Swin-L format), e.g.
#   --cfg-options model.backbone.init_cfg.checkpoint=/path/to/swin_large_patch4_window12_384_22k.pth
_base_ = ['./cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py', '../_base_/fsdp.py']

model = dict(backbone={{_base_.swin_l}}, neck=dict(in_channels={{_base_.swin_l_channels}}))
# Mixed precision: bf16 autocast without a loss scaler (bf16 has fp32's range; Ampere and later).
# FSDP keeps fp32 parameter shards. V100: type='AmpOptimWrapper', dtype='float16' (mmengine then
# gives it FSDP's sharded loss scaler).
optim_wrapper = dict(type='swin_backbone.mmlab.optim.BF16AutocastOptimWrapper')
default_hooks = dict(checkpoint=dict(max_keep_ckpts=3))
