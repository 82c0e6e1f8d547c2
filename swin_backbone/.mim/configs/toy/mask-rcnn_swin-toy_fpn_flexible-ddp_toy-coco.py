# The FSDP toy recipe (./mask-rcnn_swin-toy_fpn_fsdp_toy-coco.py) with DDPStrategy instead of
# FSDPStrategy, everything else equal: the reference its FSDP run is compared with
# (tests/mmlab/test_fsdp.py). Same runner (FlexibleRunner), so the same seed gives the same
# initial weights and data order. CPU: DDP without device ids.
_base_ = './mask-rcnn_swin-toy_fpn_fsdp_toy-coco.py'

strategy = dict(_delete_=True, _scope_='mmengine', type='DDPStrategy',
                model_wrapper=dict(type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False))
