# Mask R-CNN + Swin-T 3x (multi-scale + crop) with shape buckets and the backbone compiled whole
# with CUDA graphs (docs/shape-buckets.md). For CUDA GPUs; opt-in (GPU figures:
# docs/performance.md, "Shape buckets"). The recipe makes hundreds of batch shapes (315 in 2000
# drawn batches); these 4 buckets make 7 (1344x1344 serves both orientations and holds every
# batch of images at most 1333 on their long side, which this resize guarantees) at a padding
# share of 35% (19% without buckets): a trade-off, measure it. Each image's features stay those
# of the image alone. Chosen with `swin-buckets ... --pick 4 --bound 1344x1344`.
_base_ = ['./mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py']

model = dict(
    data_preprocessor=dict(buckets=[(672, 896), (768, 1024), (800, 1216), (1344, 1344)]),
    backbone=dict(compile=dict(mode='reduce-overhead', dynamic=False, regions=False)))
