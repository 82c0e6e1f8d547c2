# RetinaNet + Swin-T 1x with shape buckets and the backbone compiled whole with CUDA graphs
# (docs/shape-buckets.md). For CUDA GPUs; opt-in (GPU figures: docs/performance.md, "Shape
# buckets"). The same resize as Mask R-CNN 1x, so the same bucket: 2 batch shapes in training
# (one per orientation), every batch of the recipe fits; padding share 16.1% (5.7% without;
# three buckets, (800, 1088), (800, 1216), (800, 1344): 5.8% for 6 graphs).
_base_ = ['./retinanet_swin-t-p4-w7_fpn_1x_coco.py']

model = dict(
    data_preprocessor=dict(buckets=[(800, 1344)]),
    backbone=dict(compile=dict(mode='reduce-overhead', dynamic=False, regions=False)))
