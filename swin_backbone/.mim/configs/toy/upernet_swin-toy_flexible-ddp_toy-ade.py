# The FSDP toy UPerNet (./upernet_swin-toy_fsdp_toy-ade.py) with DDPStrategy instead, everything
# else equal (same runner, seed, data order): the reference its FSDP run is compared with
# (tests/mmlab/test_fsdp_seg.py). CPU: DDP without device ids.
_base_ = './upernet_swin-toy_fsdp_toy-ade.py'

strategy = dict(_delete_=True, _scope_='mmengine', type='DDPStrategy',
                model_wrapper=dict(type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False))
