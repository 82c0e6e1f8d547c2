# The FSDP segmentation recipe's shape at toy size, for the CPU: the toy UPerNet
# (./upernet_swin-toy_toy-ade.py) on FlexibleRunner with FSDP (configs/_base_/fsdp.py), with_cp,
# a frozen first stage, and sharded checkpoints (state_dict_cfg='local': iter_N.pth/rankK.pth).
# Run with --amp (bf16 autocast, as the large recipes) it is compared with the same recipe under
# DDP (./upernet_swin-toy_flexible-ddp_toy-ade.py) by tests/mmlab/test_fsdp_seg.py.
_base_ = ['./upernet_swin-toy_toy-ade.py', '../_base_/fsdp.py']

# no drop path: the FSDP and DDP runs then draw the same random numbers (the data pipeline's only)
model = dict(backbone=dict(frozen_stages=1, with_cp=True, drop_path_rate=0.0))
# FSDP on the CPU (mmengine passes device_id=LOCAL_RANK, a GPU index); remove on GPUs
strategy = dict(model_wrapper=dict(device_id='cpu'), state_dict_cfg='local')
