"""SwinBackbone(compile=...): its regions compiled (regional compilation, CPU inductor), outputs and
gradients equal eager's, and no recompiles across input and batch sizes once each kind of
forward has compiled (the graphs each kind adds are counted with dynamo's own counters)."""
from __future__ import annotations

import logging

import pytest
import torch

from swin_backbone import SwinBackbone
from swin_backbone.model.backbone import COMPILE_NOTES
from swin_backbone.torch_compat import compile_unsupported_reason, torch_version

pytestmark = pytest.mark.slow  # torch.compile (inductor): out of `make test-fast`

# Tiny and one stage (each graph is an inductor compile of about 10-20 s on a CPU); window 4,
# no stochastic depth (inductor's random numbers are not eager's).
CFG = dict(arch=None, embed_dims=16, depths=(2,), num_heads=(2,), window_size=4, out_indices=(0,),
           drop_path_rate=0.0)

needs_compile = pytest.mark.skipif(
    torch_version() < (2, 2) or compile_unsupported_reason() is not None,
    reason="compile=True needs torch >= 2.2 with a working torch.compile",
)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def models():
    """``(eager, compiled)``: the same weights; the compiled one is shared by every test here."""
    torch.manual_seed(0)
    eager = SwinBackbone(**CFG)
    eager.init_weights()
    compiled = SwinBackbone(**CFG, compile=True)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


class Records(logging.Handler):
    """The messages of the logger it is added to (mmengine's current logger does not propagate)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _run(models, x, train=False, valid_sizes=None, with_cp=False):
    """Both models on ``x``: ``(max output difference, max over parameters of the gradient's
    difference relative to its largest value, or None in eval)``."""
    diffs, grads = [], []
    outs = []
    for model in models:
        model.train(train)
        model.stages[0].with_cp = with_cp
        model.zero_grad()
        with torch.set_grad_enabled(train):
            out = model(x, valid_sizes)
            if train:  # (a random projection: the sum of squares' gradient vanishes through the norms)
                weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(1)) for o in out]
                sum((o * w).sum() for o, w in zip(out, weights)).backward()
        outs.append(out)
    eager, compiled = models
    diffs = [(a - b).abs().max().item() for a, b in zip(*outs)]
    if train:
        grads = [(a.grad - b.grad).abs().max().item() / (a.grad.abs().max().item() + 1e-12)
                 for a, b in zip(eager.parameters(), compiled.parameters()) if a.grad is not None]
        assert len(grads) == sum(1 for p in eager.parameters() if p.requires_grad)
    for model in models:
        model.stages[0].with_cp = False
    return max(diffs), max(grads) if grads else None


def test_compile_values_are_checked():
    for bad, expected in (("yes", "compile: expected True, False or a dict"),
                          (dict(mode="default", foo=1), "compile: expected a dict of torch.compile options"),
                          (dict(regions="no"), "compile['regions']: expected True or False"),
                          (dict(fullgraph="no"), "compile['fullgraph']: expected True or False"),
                          (dict(mode=3), "compile['mode']"), (dict(backend=1), "compile['backend']")):
        with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            SwinBackbone(**CFG, compile=bad)


@needs_compile
def test_forwards_with_cuda_graphs_mark_their_steps():
    """Which compile options make a CUDA forward mark a CUDA-graph step (its regions replayed as CUDA
    graphs; without the mark an inference forward's regions free each other's outputs: a
    RuntimeError measured on an H200, docs/compiled-mode.md). The marking itself runs on CUDA only."""
    import torch._inductor.config as inductor_config

    from swin_backbone.model.compiled import cuda_graph_steps

    with inductor_config.patch({"triton.cudagraphs": False}):
        for options, expected in ((dict(mode="reduce-overhead"), True), (dict(mode="max-autotune"), True),
                                  (dict(mode="max-autotune-no-cudagraphs"), False), (dict(mode="default"), False),
                                  (dict(mode=None), False), ({}, False), (dict(options={"triton.cudagraphs": True}), True),
                                  (dict(mode="reduce-overhead", options={"triton.cudagraphs": False}), False),
                                  (dict(backend="cudagraphs"), True), (dict(backend="eager", mode="reduce-overhead"), False),
                                  (dict(backend="inductor", mode="reduce-overhead", dynamic=False), True)):
            assert cuda_graph_steps(options) is expected, options
            assert cuda_graph_steps(dict(options, regions=False)) is expected  # compiled whole: one call, one step
        assert cuda_graph_steps(None) is False  # eager
    with inductor_config.patch({"triton.cudagraphs": True}):  # (TORCHINDUCTOR_CUDAGRAPHS=1 sets it process-wide)
        assert cuda_graph_steps(dict(mode="default")) is True
    # what the backbone's forward reads (it marks on CUDA tensors only)
    assert SwinBackbone(**CFG, compile=dict(mode="reduce-overhead")).marks_cuda_graph_steps
    assert SwinBackbone(**CFG, compile=dict(mode="reduce-overhead")).regions_compiled
    whole = SwinBackbone(**CFG, compile=dict(mode="reduce-overhead", regions=False))
    assert not whole.regions_compiled and whole.marks_cuda_graph_steps
    assert not SwinBackbone(**CFG, compile=True).marks_cuda_graph_steps
    assert not SwinBackbone(**CFG).marks_cuda_graph_steps and not SwinBackbone(**CFG).regions_compiled


@pytest.mark.skipif(torch_version() >= (2, 2), reason="the error of a torch without nn.Module.compile")
def test_old_torch_names_the_version_needed():
    with pytest.raises(RuntimeError, match=r"compile: needs torch >= 2\.2"):
        SwinBackbone(**CFG, compile=True)


@needs_compile
def test_built_from_a_config_compiles_its_regions():
    from mmdet.registry import MODELS  # (importing swin_backbone registered SwinBackbone there)

    model = MODELS.build(dict(type="SwinBackbone", **CFG, compile=dict(mode="default")))
    assert model.compile_options == dict(dynamic=True, mode="default")
    regions = [model.patch_embed, *model.stages[0].blocks, model.norm0]
    assert all(m._compiled_call_impl is not None for m in regions)
    others = [m for m in model.modules() if m not in regions and getattr(m, "_compiled_call_impl", None) is not None]
    assert others == []
    # Several stages: each stage's patch merging too, and every output norm (building compiles nothing yet).
    deep = SwinBackbone(arch=None, embed_dims=16, depths=(2, 2, 2), num_heads=(2, 2, 2), window_size=4,
                        out_indices=(1, 2), compile=True)
    merging = [s.downsample for s in deep.stages if s.downsample is not None]
    assert len(merging) == 2 and deep.stages[2].downsample is None
    compiled = [m for m in deep.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert compiled == [deep.patch_embed, *deep.stages[0].blocks, merging[0], *deep.stages[1].blocks, merging[1],
                        *deep.stages[2].blocks, deep.norm1, deep.norm2]
    # the parameters keep their names (checkpoints load as into an eager backbone)
    assert model.state_dict().keys() == SwinBackbone(**CFG).state_dict().keys()
    assert SwinBackbone(**CFG).compile_options is None  # eager is the default
    # regions=False from a config: the backbone's static forward compiled, none of its modules
    whole = MODELS.build(dict(type="SwinBackbone", **CFG, compile=dict(mode="reduce-overhead", dynamic=False,
                                                                         regions=0)))
    assert whole.compile_options == dict(mode="reduce-overhead", dynamic=False, regions=False)
    assert whole.whole_graph is not None and model.whole_graph is None
    assert [n for n, m in whole.named_modules() if getattr(m, "_compiled_call_impl", None) is not None] == []


@needs_compile
def test_eval_equals_eager_and_sizes_do_not_recompile(models):
    from mmengine.logging import MMLogger

    logger, records = MMLogger.get_current_instance(), Records()
    logger.addHandler(records)
    try:
        before = _graphs()
        diff, _ = _run(models, torch.randn(2, 3, 32, 40))
        first = _graphs() - before
    finally:
        logger.removeHandler(records)
    assert diff < 1e-4
    # observed: 4 graphs: the patch embedding, the stage's plain-window and shifted blocks, the output norm
    assert 3 <= first <= 4, first
    assert any("compile=True on cpu" in m and "slower" in m for m in records.messages), records.messages
    assert "faster" in COMPILE_NOTES["cuda"] and "slower" in COMPILE_NOTES["cpu"]
    before = _graphs()
    for shape in ((3, 3, 48, 36), (2, 3, 61, 57), (5, 3, 17, 9)):
        diff, _ = _run(models, torch.randn(*shape))
        assert diff < 1e-4, shape
    assert _graphs() == before  # 0 recompiles across sizes and batch sizes > 1


@needs_compile
def test_batch_of_one_compiles_once_more(models):
    # (attention_in_windows branches on batch == 1: dynamic shapes specialise sizes 0 and 1)
    before = _graphs()
    diff, _ = _run(models, torch.randn(1, 3, 32, 40))
    assert diff < 1e-4
    assert _graphs() - before <= 4  # (at most as many as for batches > 1)
    before = _graphs()
    diff, _ = _run(models, torch.randn(1, 3, 45, 50))
    assert diff < 1e-4
    assert _graphs() == before


@needs_compile
def test_training_gradients_equal_eager_without_recompiles(models):
    _run(models, torch.randn(2, 3, 32, 40), train=True)  # compiles the training graph(s)
    before = _graphs()
    for shape in ((3, 3, 44, 36), (2, 3, 29, 53)):
        diff, grad = _run(models, torch.randn(*shape), train=True)
        assert diff < 1e-4 and grad < 1e-3, (shape, diff, grad)
    assert _graphs() == before


@needs_compile
def test_with_cp_and_ddp(models, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _run(models, torch.randn(2, 3, 32, 40), train=True, with_cp=True)
    before = _graphs()
    diff, grad = _run(models, torch.randn(3, 3, 36, 44), train=True, with_cp=True)
    assert diff < 1e-4 and grad < 1e-3
    assert _graphs() == before
    eager, compiled = models
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        compiled.train()
        ddp = DistributedDataParallel(compiled)
        for shape in ((2, 3, 32, 40), (3, 3, 40, 28)):
            compiled.zero_grad()
            sum(o.square().sum() for o in ddp(torch.randn(*shape))).backward()
    finally:
        dist.destroy_process_group()
    assert all(p.grad is not None for p in compiled.parameters() if p.requires_grad)
    assert _graphs() == before


@needs_compile
def test_compiled_whole_is_one_graph_equal_to_eager(models):
    # compile=dict(regions=False): the backbone's static forward compiled, one graph per kind of
    # forward, no graph breaks; outputs and gradients as eager's.
    from mmengine.logging import MMLogger
    from torch._dynamo.utils import counters

    eager, _ = models
    logger, records = MMLogger.get_current_instance(), Records()
    logger.addHandler(records)
    try:
        whole = SwinBackbone(**CFG, compile=dict(regions=False, backend="aot_eager"))
    finally:
        logger.removeHandler(records)
    assert any("regions=False" in m and "once per input size" in m for m in records.messages), records.messages
    whole.load_state_dict(eager.state_dict())
    assert whole.compile_options == dict(dynamic=True, regions=False, backend="aot_eager")
    assert whole.whole_graph is not None
    assert [n for n, m in whole.named_modules() if getattr(m, "_compiled_call_impl", None) is not None] == []
    assert whole.state_dict().keys() == eager.state_dict().keys()
    before, breaks = _graphs(), sum(counters["graph_break"].values())
    diff, _ = _run((eager, whole), torch.randn(2, 3, 32, 40))
    assert diff < 1e-4
    diff, grad = _run((eager, whole), torch.randn(2, 3, 32, 40), train=True)
    assert diff < 1e-4 and grad < 1e-3
    assert _graphs() - before == 2 and sum(counters["graph_break"].values()) == breaks  # eval, training
    # Per-image valid sizes are a tensor input of one more graph (masks, not packing): image-exact
    # as eager's, and other sizes in a batch of the same shape add no graph.
    x = torch.randn(2, 3, 32, 40)
    for model in (eager, whole):
        model.eval()
    graphs = _graphs()
    for sizes in ([(32, 40), (20, 30)], [(11, 40), (32, 17)], [(32, 40), (32, 40)]):
        with torch.no_grad():
            expected, got = eager(x, sizes), whole(x, sizes)
        assert max((e - g).abs().max() for e, g in zip(expected, got)) < 1e-5
    assert got[0][1, :, 5:].abs().max() == 0 or sizes[1][0] == 32
    with torch.no_grad():
        assert whole(x, [(32, 40), (20, 30)])[0][1, :, 5:].abs().max() == 0  # (20 pixels: 5 tokens)
    assert _graphs() == graphs + 1


@needs_compile
def test_stochastic_depth_rates_share_a_graph():
    # Four blocks of one stage at rates 0, 0.1, 0.2, 0.3 (the first returns its input): the three
    # dropping blocks share one training graph, their rates graph inputs rather than constants
    # dynamo specialises (which compiled one graph per rate: 6 here). Then none for other sizes.
    # (Its own width: no graph of the shared fixture's model fits it.)
    torch.manual_seed(0)
    cfg = dict(CFG, embed_dims=24, depths=(4,), drop_path_rate=0.3)
    model = SwinBackbone(**cfg, compile=True).train()
    assert [getattr(b.drop_path, "drop_prob", 0.0) for b in model.stages[0].blocks] == pytest.approx([0, 0.1, 0.2, 0.3])

    def new_graphs(*shape) -> int:
        before = _graphs()
        model.zero_grad()
        sum(o.square().sum() for o in model(torch.randn(*shape))).backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        return _graphs() - before

    # the patch embedding, the rate-0 block, the dropping blocks, the output norm
    assert new_graphs(2, 3, 32, 40) == 4
    assert new_graphs(3, 3, 36, 44) == 0


@needs_compile
def test_valid_sizes_packed_layout(models):
    # The blocks get the images' packed (1, T, C) tokens: graphs of their own (eval, training),
    # then none for other images and batches, 2 or 3 images.
    batches = [((2, 3, 48, 48), [(48, 30), (25, 48)]), ((3, 3, 44, 52), [(44, 30), (20, 52), (9, 13)]),
               ((2, 3, 40, 40), [(40, 40), (33, 17)])]
    for i, (shape, sizes) in enumerate(batches):
        if i == 1:
            before = _graphs()
        x = torch.randn(*shape)
        diff, _ = _run(models, x, valid_sizes=sizes)
        assert diff < 1e-4, sizes
        diff, grad = _run(models, x, train=True, valid_sizes=sizes)
        assert diff < 1e-4 and grad < 1e-3, sizes
    # Stochastic depth off: drop_samples reads the per-image token counts only where it drops, so
    # the image count is not guarded; the compiled blocks' packed layouts list no padding slots
    # (whose count dynamic shapes had equated with the window count: 4 graphs when run alone).
    assert _graphs() == before


@needs_compile
def test_v2_compiled_equals_eager():
    from swin_backbone import SwinV2Backbone

    torch.manual_seed(0)
    cfg = dict(CFG, pad_small_map=True)
    eager = SwinV2Backbone(**cfg).eval()
    eager.init_weights()
    with torch.no_grad():  # post-norms start at zero: make them non-trivial
        for name, p in eager.named_parameters():
            if "norm" in name:
                p.normal_()
    compiled = SwinV2Backbone(**cfg, compile=True).eval()
    compiled.load_state_dict(eager.state_dict())
    assert all(b._compiled_call_impl is not None for b in compiled.stages[0].blocks)
    for shape in ((2, 3, 32, 40), (3, 3, 27, 45)):
        diff, _ = _run((eager, compiled), torch.randn(*shape))
        assert diff < 1e-4, shape
