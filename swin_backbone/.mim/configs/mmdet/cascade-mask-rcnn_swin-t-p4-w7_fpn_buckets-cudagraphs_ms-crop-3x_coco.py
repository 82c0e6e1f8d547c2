# Cascade Mask R-CNN + Swin-T 3x (multi-scale + crop) with shape buckets and the backbone
# compiled whole with CUDA graphs (docs/shape-buckets.md). For CUDA GPUs; opt-in (GPU figures:
# docs/performance.md, "Shape buckets"). The same pipeline as Mask R-CNN 3x, so the same
# buckets: 7 batch shapes instead of hundreds, every batch of the recipe fits, padding share 35%
# (19% without buckets): a trade-off, measure it. Each image's features stay image-exact.
_base_ = ['./cascade-mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py']

model = dict(
    data_preprocessor=dict(buckets=[(672, 896), (768, 1024), (800, 1216), (1344, 1344)]),
    backbone=dict(compile=dict(mode='reduce-overhead', dynamic=False, regions=False)))
