"""Static shapes for shape buckets (docs/shape-buckets.md): ``SwinBackbone.forward_static`` (the
whole map, per-image sizes as a tensor, a mask per image) gives each image the features it has
alone, as the packed ``valid_sizes`` forward does, in eval and training; compiled whole with
``dynamic=False`` it is one graph per bucket shape and kind of forward, whatever the images' sizes."""
from __future__ import annotations

import pytest
import torch

from swin_backbone import SwinBackbone, SwinV2Backbone
from swin_backbone.torch_compat import compile_unsupported_reason, torch_version

pytestmark = pytest.mark.slow  # torch.compile: out of `make test-fast`

# Four stages (late maps smaller than the window: padded windows, shifted), odd sizes.
CFG = dict(arch=None, embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4), window_size=4, drop_path_rate=0.0)
SIZES = [(60, 88), (33, 70), (9, 5)]  # (h, w) of three images in a 60 x 88 batch

needs_compile = pytest.mark.skipif(
    torch_version() < (2, 2) or compile_unsupported_reason() is not None,
    reason="compile needs torch >= 2.2 with a working torch.compile",
)


def _batch(sizes, height, width, seed=0):
    """``(B, 3, height, width)``: random images at the top left, padding non-zero (as a preprocessor
    with another pad value would leave it: the backbone must not read it)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.full((len(sizes), 3, height, width), 3.0)
    for b, (h, w) in enumerate(sizes):
        x[b, :, :h, :w] = torch.randn(3, h, w, generator=gen)
    return x


def _model(cls=SwinBackbone, **kw):
    torch.manual_seed(0)
    model = cls(**{**CFG, **kw})
    model.init_weights()
    return model


@pytest.mark.parametrize("cls", [SwinBackbone, SwinV2Backbone])
def test_each_image_as_alone(cls):
    model = _model(cls).eval()
    x = _batch(SIZES, 60, 88)
    with torch.no_grad():
        static = model.forward_static(x, torch.tensor(SIZES))
        for b, (h, w) in enumerate(SIZES):
            alone = model(x[b:b + 1, :, :h, :w].clone())
            for i, (got, want) in enumerate(zip(static, alone)):
                hh, ww = want.shape[-2:]
                assert (got[b, :, :hh, :ww] - want[0]).abs().max() < 1e-5, (b, i)
                assert got[b, :, hh:].abs().sum() == 0 and got[b, :, :, ww:].abs().sum() == 0, (b, i)
        # without sizes: the plain forward of the whole input
        assert all((s - p).abs().max() < 1e-5 for s, p in zip(model.forward_static(x), model(x)))


def test_training_gradients_equal_the_packed_forward():
    # the packed valid_sizes forward (eager) and the static one: outputs, input and parameter gradients
    static, packed = _model().train(), _model().train()
    grads = []
    for model, run in ((static, lambda m, x: m.forward_static(x, torch.tensor(SIZES))),
                       (packed, lambda m, x: m(x, valid_sizes=SIZES))):
        x = _batch(SIZES, 60, 88).requires_grad_()
        outs = run(model, x)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        grads.append((outs, x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (outs_s, xg_s, pg_s), (outs_p, xg_p, pg_p) = grads
    assert max((a - b).abs().max() for a, b in zip(outs_s, outs_p)) < 1e-5
    assert (xg_s - xg_p).abs().max() < 1e-5 and xg_s[2, :, 9:].abs().max() == 0  # (nothing beyond an image)
    assert pg_s.keys() == pg_p.keys() and len(pg_s) > 0
    for name in pg_s:
        scale = pg_p[name].abs().max().clamp_min(1e-6)
        assert (pg_s[name] - pg_p[name]).abs().max() / scale < 1e-4, name


@needs_compile
def test_compiled_whole_one_graph_per_bucket_and_kind():
    """compile=dict(regions=False, dynamic=False): batches of one shape share a graph whatever
    their images' sizes (a training step and eval each compile once per shape); a second shape
    adds one; features stay image-exact. The compile count is dynamo's own (CompileCounter)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    eager = _model()
    whole = _model(compile=dict(backend=counter, dynamic=False, regions=False))
    buckets = [(60, 88), (88, 60)]
    for step in range(6):
        height, width = buckets[step % 2]
        sizes = [(height - 7 * step, width - 3 * step), (height // 2 + step, width)]
        x = _batch(sizes, height, width, seed=step)
        outs = []
        for model in (eager, whole):
            model.zero_grad()
            out = model(x, valid_sizes=sizes)
            sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in out).backward()
            outs.append(out)
        assert max((a - b).abs().max() for a, b in zip(*outs)) < 1e-4
        grad = max((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-6)
                   for p, q in zip(whole.parameters(), eager.parameters()) if q.grad is not None)
        assert grad < 1e-3
        assert counter.frame_count == min(step + 1, 2)  # one training graph per bucket, none after
    whole.eval()
    with torch.no_grad():
        for sizes in ([(60, 88), (20, 30)], [(5, 5), (60, 1)]):
            whole(_batch(sizes, 60, 88), valid_sizes=sizes)
    assert counter.frame_count == 3  # eval: one graph for the bucket


@needs_compile
def test_inductor_buckets_are_the_captures():
    # CPU inductor (the code CUDA graphs would replay on a GPU is inductor's): two bucket shapes,
    # six batches of varied images -> two compiled graphs, outputs equal to eager.
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = dict(depths=(2,), num_heads=(2,), out_indices=(0,))
    counter = CompileCounterWithBackend("inductor")
    eager, whole = _model(**cfg).eval(), _model(**cfg, compile=dict(backend=counter, dynamic=False,
                                                                    regions=False)).eval()
    with torch.no_grad():
        for step in range(6):
            height, width = [(24, 36), (36, 24)][step % 2]
            sizes = [(height - step, width - 2 * step), (7 + step, 9)]
            x = _batch(sizes, height, width, seed=step)
            assert (whole(x, valid_sizes=sizes)[0] - eager(x, valid_sizes=sizes)[0]).abs().max() < 1e-4
    assert counter.frame_count == 2


@needs_compile
def test_absolute_position_embedding_runs_the_packed_forward():
    # per-image resized position embeddings are not static: a compiled-whole backbone runs such a
    # forward eagerly (packed, image-exact), compiling nothing
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    model = _model(use_abs_pos_embed=True, pretrain_img_size=32,
                   compile=dict(backend=counter, dynamic=False, regions=False)).eval()
    x = _batch(SIZES, 60, 88)
    with torch.no_grad():
        got = model(x, valid_sizes=SIZES)
        assert counter.frame_count == 0
        alone = model.forward_static(x[1:2, :, :33, :70].clone())
    assert (got[0][1, :, :9, :18] - alone[0][0]).abs().max() < 1e-5
