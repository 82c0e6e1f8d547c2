# RetinaNet + FPN, Swin-T, 1x. Only stages 1-3 feed the FPN (out_indices=(1, 2, 3),
# start_level=0); stage 0 still runs, its output norm is not built.
_base_ = ['mmdet::swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py', '../_base_/swin_backbone.py']

# data_preprocessor: the library's preprocessor that also hands each image's size to the
# backbone, so features do not depend on batch padding (README: image-exact batches).
model = dict(
    data_preprocessor=dict(type='SwinDetDataPreprocessor'),
    backbone={{_base_.swin_t_c345}},
    neck=dict(in_channels=[192, 384, 768], start_level=0, num_outs=5))

# The Swin recipe: AdamW, no weight decay on norms and position tables.
optim_wrapper = dict(
    type='OptimWrapper',
    paramwise_cfg={{_base_.swin_paramwise_cfg}},
    optimizer=dict(_delete_=True, type='AdamW', lr=0.0001, betas=(0.9, 0.999), weight_decay=0.05))
