# The large-model recipe's shape at toy size, for the CPU: the toy Mask R-CNN on mmengine's
# FlexibleRunner with FSDP (configs/_base_/fsdp.py: one unit per Swin block, original parameters,
# one checkpoint file per save), activation checkpointing, a frozen first stage, per-stage
# learning rates and gradient clipping.
# tests/mmlab/test_fsdp.py trains it with 2 gloo processes.
_base_ = ['./mask-rcnn_swin-toy_fpn_toy-coco.py', '../_base_/fsdp.py']

model = dict(backbone=dict(frozen_stages=1, with_cp=True, drop_path_rate=0.0))
# FSDP on the CPU: mmengine passes device_id=LOCAL_RANK (a GPU index); on a machine without
# one, FSDP must be told to compute on the CPU. Remove this line on GPUs.
strategy = dict(model_wrapper=dict(device_id='cpu'))
# layer-wise (here: stage-wise) learning rates through paramwise_cfg, as under DDP; the toy's
# clip_grad (max_norm 10) clips by the whole model's gradient norm (SwinFSDPStrategy)
optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'backbone.stages.1': dict(lr_mult=0.5),
        'backbone.stages.2': dict(lr_mult=0.75),
    }))
