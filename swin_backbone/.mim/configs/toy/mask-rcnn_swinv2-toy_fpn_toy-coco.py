# Mask R-CNN + FPN with a small Swin V2 (embed 48, depths 2-2-2-2, window 8) on the generated
# toy COCO (tools/make_toy_data.py), from scratch on CPU. Everything but the backbone type,
# window and no-decay keys is the V1 toy config's.
_base_ = './mask-rcnn_swin-toy_fpn_toy-coco.py'

model = dict(backbone=dict(type='SwinV2Backbone', window_size=8, pretrained_window_sizes=0,
                            pad_small_map=True))  # image-exact batches (see _base_/swinv2_backbone.py)
optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys=dict(cpb_mlp=dict(decay_mult=0.), logit_scale=dict(decay_mult=0.))))
