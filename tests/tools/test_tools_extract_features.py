"""Feature extraction: API and tool, on real photographs (scikit-image's bundled samples) and
generated odd-sized images."""
import csv
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from swin_backbone import SwinBackbone
from swin_backbone.features import FeatureExtractor, extract_features, pca_rgb
from tools import extract_features as tool

from ..conftest import small_arch


@pytest.fixture(scope="module")
def photos():
    data = pytest.importorskip("skimage.data")
    # real photographs shipped inside the scikit-image wheel (never downloaded)
    return {"astronaut": data.astronaut(), "coffee": data.coffee(), "chelsea": data.chelsea()}


@pytest.fixture()
def extractor():
    model = SwinBackbone(**small_arch())
    model.init_weights()
    return FeatureExtractor(model, batch_size=3)


def test_api_shapes_on_photographs(photos, extractor):
    images = list(photos.values())
    feats = extractor(images)
    for image, f in zip(images, feats):
        h, w = image.shape[:2]
        assert sorted(f) == [0, 1, 2, 3]
        assert f[0].shape == (32, -(-h // 4), -(-w // 4))
        assert all(torch.isfinite(t).all() for t in f.values())


def test_batch_equals_single(extractor):
    rng = np.random.RandomState(0)
    images = [rng.randint(0, 255, size=s, dtype=np.uint8) for s in [(45, 67, 3), (45, 67, 3), (31, 99, 3), (45, 67, 3)]]
    together = extractor(images)
    for image, feats in zip(images, together):
        (alone,) = extractor([image])
        for s in feats:
            torch.testing.assert_close(feats[s], alone[s], rtol=1e-5, atol=1e-5)
    # on the CPU a batch never mixes sizes (tests/tools/test_features_mixed_sizes.py: where it does)
    assert not extractor.mixed_sizes
    assert list(extractor.batches([(45, 67), (45, 67), (31, 99), (45, 67)])) == [[0, 1, 3], [2]]


def test_resize_stages_and_one_call_api():
    images = [np.zeros((50, 70, 3), np.uint8), np.full((20, 90, 3), 200, np.uint8)]
    fx = FeatureExtractor(SwinBackbone(**small_arch()), stages=[1, 3], resize=(64, 64))
    feats = fx(images)
    assert [sorted(f) for f in feats] == [[1, 3], [1, 3]]
    assert feats[0][1].shape == (64, 8, 8) and feats[1][3].shape == (256, 2, 2)
    out = extract_features([images[0]], arch="tiny", stages=[0])
    assert out[0][0].shape == (96, 13, 18)


def test_pca_png_is_an_image():
    rgb = pca_rgb(torch.randn(16, 5, 7))
    assert rgb.shape == (5, 7, 3) and rgb.dtype == np.uint8 and rgb.max() == 255
    assert pca_rgb(torch.randn(4, 1, 1)).shape == (1, 1, 3)


def _write_inputs(root, photos):
    os.makedirs(root / "nested", exist_ok=True)
    Image.fromarray(photos["astronaut"][::4, ::4]).save(root / "astronaut.jpg")
    Image.fromarray(photos["coffee"][::5, ::5]).save(root / "nested" / "coffee.png")
    rng = np.random.RandomState(1)
    Image.fromarray(rng.randint(0, 255, (33, 61, 3), dtype=np.uint8)).save(root / "odd.png")
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    good = open(root / "odd.png", "rb").read()
    (root / "truncated.png").write_bytes(good[: len(good) // 3])


@pytest.mark.parametrize("fmt", ["npz", "npy", "pt"])
def test_tool_writes_features_index_and_pngs(tmp_path, photos, fmt, capsys):
    src = tmp_path / "images"
    _write_inputs(src, photos)
    out = tmp_path / "features"
    summary = tool.main([str(src), str(out), "--arch", "tiny", "--stages", "0", "2", "--format", fmt,
                         "--png", "--no-progress", "--batch-size", "2", "--random-weights"])
    assert summary["images"] == 3
    failed = sorted(os.path.basename(f["image"]) for f in summary["failed"])
    assert failed == ["broken.jpg", "truncated.png"]
    assert "skipped" in capsys.readouterr().err
    index = json.load(open(out / "index.json"))
    rows = list(csv.DictReader(open(out / "index.csv")))
    assert len(index["features"]) == len(rows) == 6
    for row in index["features"]:
        path = out / row["file"]
        assert path.is_file()
        if fmt == "npz":
            arr = np.load(path)[row["key"]]
        elif fmt == "npy":
            arr = np.load(path)
        else:
            arr = torch.load(path).numpy()
        assert list(arr.shape) == row["shape"] and arr.dtype == np.float32
    # output mirrors the input tree; PNGs open and show the image beside the PCA panel
    png = Image.open(out / "nested" / "coffee.stage2.png")
    assert png.size[0] > 2 * (photos["coffee"].shape[1] // 5) and png.mode == "RGB"
    assert not list(out.rglob("*.tmp*"))


def test_tool_rerun_skips_complete_and_overwrite_redoes(tmp_path, photos):
    src = tmp_path / "images"
    _write_inputs(src, photos)
    out = tmp_path / "features"
    args = [str(src), str(out), "--arch", "tiny", "--no-progress", "--random-weights"]
    tool.main(args)
    first = {p: p.stat().st_mtime_ns for p in out.rglob("*.npz")}
    again = tool.main(args)
    assert again["images"] == 3 and again["new"] == 0 and again["resumed"] == 3
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.npz")} == first  # not rewritten
    redone = tool.main(args + ["--overwrite"])
    assert redone["new"] == 3 and redone["resumed"] == 0
    second = {p: p.stat().st_mtime_ns for p in out.rglob("*.npz")}
    assert first.keys() == second.keys() and all(second[p] > first[p] for p in first)
    assert not list(out.rglob("*.tmp*"))


def test_tool_from_config_and_glob(tmp_path, photos):
    src = tmp_path / "images"
    _write_inputs(src, photos)
    summary = tool.main([str(src / "astro*.jpg"), str(tmp_path / "f"), "--config",
                         "configs/toy/mask-rcnn_swin-toy_fpn_toy-coco.py", "--no-progress", "--random-weights"])
    assert summary["images"] == 1 and not summary["failed"]
