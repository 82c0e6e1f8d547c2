"""The measurements behind ``swin-benchmark`` (:mod:`swin_backbone.tools.benchmark` parses the
command line and picks the run):

* :mod:`.builders`: the models compared (ours, mmdet's, timm's, torchvision's; V1 and V2);
* :mod:`.steps`: one step of a model (eval, training), under planner overrides, TF32, ``torch.compile``;
* :mod:`.measure`: interleaved timing, FLOPs, the matmul ceiling, which attention ran;
* :mod:`.memory`: peak training memory in a fresh process per model;
* :mod:`.report`: the printed rows, and the ``--json`` file;
* :mod:`.rows`: rows both runs share (image-exact batches, Swin V2, UPerNet);
* :mod:`.cpu`, :mod:`.cuda`, :mod:`.compiled`, :mod:`.ablation`: the runs.
"""
