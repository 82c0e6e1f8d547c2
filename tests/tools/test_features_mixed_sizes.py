"""FeatureExtractor batches images of different sizes together where the backbone takes
per-image valid sizes, and each image's features equal those of the image alone."""
import numpy as np
import pytest
import torch

from swin_backbone import SwinBackbone
from swin_backbone.features import FeatureExtractor

from ..helpers import small_arch

SIZES = [(61, 83), (40, 47), (64, 32), (17, 9), (61, 83)]


def _images(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]


def _extractor(batch_size, mixed_sizes=True, **kw):
    torch.manual_seed(0)
    backbone = SwinBackbone(**small_arch(**kw))
    backbone.init_weights()
    return FeatureExtractor(backbone, batch_size=batch_size, mixed_sizes=mixed_sizes)


def test_mixed_size_batches_equal_each_image_alone():
    images = _images()
    batched = _extractor(batch_size=4)
    assert batched.mixed_sizes
    batches = list(batched.batches(SIZES))
    assert any(len({SIZES[i] for i in b}) > 1 for b in batches)  # sizes really are mixed
    alone = _extractor(batch_size=1)
    got, ref = batched(images), alone(images)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert list(g) == list(r)
        for stage in g:
            assert g[stage].shape == r[stage].shape, (i, stage)
            torch.testing.assert_close(g[stage], r[stage], rtol=1e-4, atol=1e-4)


def test_cpu_default_is_one_size_batches():
    assert not _extractor(batch_size=4, mixed_sizes=None).mixed_sizes  # CPU: batching gains nothing


@pytest.mark.parametrize("kw", [dict(mask_padding=False), dict(pad_small_map=False)])
def test_backbones_without_exact_valid_sizes_batch_one_size(kw):
    with pytest.raises(ValueError, match="mixed_sizes: expected a SwinBackbone"):
        _extractor(batch_size=4, **kw)
    fx = _extractor(batch_size=4, mixed_sizes=None, **kw)
    assert not fx.mixed_sizes
    for batch in fx.batches(SIZES):
        assert len({SIZES[i] for i in batch}) == 1
    with pytest.raises(ValueError, match="images: expected one size per batch"):
        fx.run_batch([torch.zeros(3, 8, 8), torch.zeros(3, 9, 9)])
