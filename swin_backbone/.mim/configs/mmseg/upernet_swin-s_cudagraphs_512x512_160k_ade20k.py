# UPerNet + Swin-S, ADE20K 512x512, with the backbone compiled whole with CUDA graphs
# (docs/shape-buckets.md). For CUDA GPUs; opt-in (GPU figures: docs/performance.md, "Shape
# buckets"). Training batches are already one shape (512x512 crops, padded to 512x512 by the
# preprocessor); evaluation slides a 512x512 window (stride 341, as mmseg's 512 recipes) in place
# of whole images of varied widths, so the backbone sees one shape per batch size.
_base_ = ['./upernet_swin-s_512x512_160k_ade20k.py']

model = dict(
    backbone=dict(compile=dict(mode='reduce-overhead', dynamic=False, regions=False)),
    test_cfg=dict(mode='slide', crop_size=(512, 512), stride=(341, 341)))
