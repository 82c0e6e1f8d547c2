# Mask R-CNN + Swin-T 1x with shape buckets and the backbone compiled whole with CUDA graphs
# (docs/shape-buckets.md). For CUDA GPUs; opt-in (GPU figures: docs/performance.md, "Shape
# buckets"). Each batch is padded up to the bucket (either orientation), so the backbone sees 2
# batch shapes in training and compiles and captures one graph per shape; each image's features
# stay those of the image alone (its valid size is passed on). Every batch of this recipe fits
# 800 x 1344 (images at most 800 x 1333, padded to 32). Padding share on the built-in COCO-like
# sizes (`swin-buckets`): 16.1% (5.7% without buckets); three buckets, (800, 1088), (800, 1216),
# (800, 1344), give 5.8% for 6 graphs.
_base_ = ['./mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py']

model = dict(
    data_preprocessor=dict(buckets=[(800, 1344)]),
    backbone=dict(compile=dict(mode='reduce-overhead', dynamic=False, regions=False)))
