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
from swin_backbone.features import IMAGENET_MEAN, IMAGENET_STD, FeatureExtractor, extract_features, pca_rgb
from swin_backbone.tools import extract_features as tool

from ..helpers import small_arch


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
    summary = tool.extract([str(src), str(out), "--arch", "tiny", "--stages", "0", "2", "--format", fmt,
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
    tool.extract(args)
    first = {p: p.stat().st_mtime_ns for p in out.rglob("*.npz")}
    again = tool.extract(args)
    assert again["images"] == 3 and again["new"] == 0 and again["resumed"] == 3
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.npz")} == first  # not rewritten
    redone = tool.extract(args + ["--overwrite"])
    assert redone["new"] == 3 and redone["resumed"] == 0
    second = {p: p.stat().st_mtime_ns for p in out.rglob("*.npz")}
    assert first.keys() == second.keys() and all(second[p] > first[p] for p in first)
    assert not list(out.rglob("*.tmp*"))


def test_tool_resize_maps_and_pngs(tmp_path, photos):
    src = tmp_path / "images"
    _write_inputs(src, photos)
    out = tmp_path / "features"
    summary = tool.extract([str(src), str(out), "--resize", "32", "48", "--stages", "0", "--png", "--no-progress",
                            "--random-weights"])
    assert summary["images"] == 3 and all(r["shape"] == [96, 8, 12] for r in summary["features"])
    assert Image.open(out / "odd.stage0.png").size[1] == 32  # the resized image beside its PCA panel


def test_tool_from_config_and_glob(tmp_path, photos):
    src = tmp_path / "images"
    _write_inputs(src, photos)
    summary = tool.extract([str(src / "astro*.jpg"), str(tmp_path / "f"), "--config",
                         "configs/toy/mask-rcnn_swin-toy_fpn_toy-coco.py", "--no-progress", "--random-weights"])
    assert summary["images"] == 1 and not summary["failed"]


# ---------------------------------------------------------------- Swin V2 presets
def test_from_arch_names_pick_the_swin_version_and_window():
    from swin_backbone import SwinV2Backbone
    from swin_backbone.features import default_window_size, split_arch

    assert split_arch("tiny") == (1, "tiny") and split_arch(None) == (1, None)
    assert split_arch("V2-Tiny") == (2, "tiny") and split_arch("v2-t") == (2, "t")
    assert split_arch("SwinV2_Tiny_Window16_256") == (2, "swinv2_tiny_window16_256")
    assert [default_window_size(a) for a in ("tiny", "v2-small", "swinv2_tiny_window16_256")] == [7, 8, 16]
    small = dict(embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8))
    v1 = FeatureExtractor.from_arch("tiny", **small).backbone
    assert type(v1) is SwinBackbone and v1.window_size == 7
    v2 = FeatureExtractor.from_arch("v2-tiny", **small).backbone
    assert isinstance(v2, SwinV2Backbone) and v2.window_size == 8 and v2.embed_dims == 16
    published = FeatureExtractor.from_arch("swinv2_base_window12to16_192to256", **small).backbone
    assert published.window_size == 16 and published.pretrained_window_sizes == (12, 12, 12, 6)
    fine_tune = FeatureExtractor.from_arch("v2-t", window_size=16, pretrained_window_sizes=8, **small).backbone
    assert fine_tune.window_size == 16 and fine_tune.pretrained_window_sizes == (8, 8, 8, 8)
    with pytest.raises(ValueError, match="pretrained_window_sizes"):
        FeatureExtractor.from_arch("tiny", pretrained_window_sizes=8, **small)
    with pytest.raises(ValueError, match="arch"):
        FeatureExtractor.from_arch("v2-tinyy", **small)


def test_help_lists_the_v2_names(capsys):
    with pytest.raises(SystemExit):
        tool.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("v2-tiny", "v2-giant", "swinv2_tiny_window8_256", "swinv2_large_window12to24_192to384",
                 "--pretrained-window-sizes"):
        assert name in text


@pytest.fixture(scope="module")
def timm_v2_checkpoint(tmp_path_factory):
    """A timm ``swinv2_tiny_window8_256`` checkpoint file (random weights with non-trivial
    norms and biases) and the timm model it came from."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swinv2_tiny_window8_256", pretrained=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("ckpt") / "swinv2_tiny_patch4_window8_256.pth"
    torch.save(model.state_dict(), path)
    return path, model


def test_tool_v2_preset_with_a_timm_checkpoint(tmp_path, timm_v2_checkpoint):
    ckpt, ref = timm_v2_checkpoint
    src = tmp_path / "images"
    src.mkdir()
    rng = np.random.RandomState(0)
    square = rng.randint(0, 255, (256, 256, 3), dtype=np.uint8)
    Image.fromarray(square).save(src / "square.png")
    Image.fromarray(rng.randint(0, 255, (75, 130, 3), dtype=np.uint8)).save(src / "odd.png")
    out = tmp_path / "features"
    summary = tool.extract([str(src), str(out), "--arch", "v2-tiny", "--checkpoint", str(ckpt), "--no-progress"])
    assert summary["images"] == 2 and not summary["failed"]
    settings = json.load(open(out / "settings.json"))
    assert settings["model"]["arch"] == "v2-tiny" and settings["model"]["window_size"] == 8
    odd = np.load(out / "odd.npz")
    assert [odd[f"stage{s}"].shape for s in range(4)] == [(96, 19, 33), (192, 10, 17), (384, 5, 9), (768, 3, 5)]
    # The checkpoint's weights: stages 1-3 are timm's stage outputs (through our output norms,
    # which a classification checkpoint lacks: unit LayerNorms), at 256x256 where timm's
    # windows are ours.
    got = np.load(out / "square.npz")
    x = (torch.from_numpy(square).permute(2, 0, 1)[None].float() - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
    x = x / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        y = ref.patch_embed(x)
        for s, layer in enumerate(ref.layers[:3]):
            y = layer(y)
            want = torch.nn.functional.layer_norm(y, y.shape[-1:]).permute(0, 3, 1, 2)[0]
            torch.testing.assert_close(torch.from_numpy(got[f"stage{s}"]), want, rtol=1e-4, atol=1e-4)
        # stage 4 (map 8 = window 8): timm's final norm, which ours loaded; the same window and no
        # shift there, Swin V2's small-map rule (the V2 presets' default)
        want = ref.norm(ref.layers[3](y)).permute(0, 3, 1, 2)[0]
        torch.testing.assert_close(torch.from_numpy(got["stage3"]), want, rtol=1e-4, atol=1e-4)
    # a rerun with the same settings resumes; a V1 arch on the V2 checkpoint is refused with the V2 names
    again = tool.extract([str(src), str(out), "--arch", "v2-tiny", "--checkpoint", str(ckpt), "--no-progress"])
    assert again["resumed"] == 2 and again["new"] == 0
    from swin_backbone import CheckpointError

    with pytest.raises(CheckpointError, match="v2-tiny"):
        tool.extract([str(src), str(tmp_path / "v1"), "--arch", "tiny", "--checkpoint", str(ckpt), "--no-progress"])


def test_v2_published_name_and_fine_tune_windows_in_the_tool(tmp_path, timm_v2_checkpoint):
    ckpt, _ = timm_v2_checkpoint
    src = tmp_path / "images"
    src.mkdir()
    Image.fromarray(np.random.RandomState(2).randint(0, 255, (96, 64, 3), dtype=np.uint8)).save(src / "a.png")
    out = tmp_path / "f"
    tool.extract([str(src), str(out), "--arch", "swinv2_tiny_window16_256", "--checkpoint", str(ckpt),
               "--pretrained-window-sizes", "8", "--stages", "3", "--no-progress"])
    settings = json.load(open(out / "settings.json"))["model"]
    assert settings["window_size"] == 16 and settings["pretrained_window_sizes"] == 8
    # the same as the API with the same model
    fx = FeatureExtractor.from_arch("v2-tiny", str(ckpt), window_size=16, pretrained_window_sizes=8, stages=[3])
    (want,) = fx([np.array(Image.open(src / "a.png"))])
    torch.testing.assert_close(torch.from_numpy(np.load(out / "a.npz")["stage3"]), want[3])
    with pytest.raises(SystemExit):
        tool.parse_args([str(src), str(out), "--arch", "tiny", "--pretrained-window-sizes", "8", "--random-weights"])


def test_attention_setting_reaches_the_backbone(tmp_path):
    from swin_backbone.features import FeatureExtractor
    from swin_backbone.tools.extract_features import parse_args

    fx = FeatureExtractor.from_arch(None, embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8),
                                    attention="sdpa", seed=0)
    assert fx.backbone.attention == "sdpa"
    with pytest.raises(ValueError, match="attention: expected one of"):
        FeatureExtractor.from_arch(None, embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8),
                                   attention="fast", seed=0)
    (tmp_path / "in").mkdir()
    inp, out = str(tmp_path / "in"), str(tmp_path / "out")
    assert parse_args([inp, out, "--random-weights", "--attention", "sdpa"]).attention == "sdpa"
    for removed in ("fast", "triton"):  # (triton: the fused kernel was removed)
        with pytest.raises(SystemExit):
            parse_args([inp, out, "--random-weights", "--attention", removed])


def test_progress_bar_on_stderr_unless_no_progress(tmp_path, capsys):
    from ..helpers import EXTRACT_ARGS, write_images

    write_images(tmp_path / "in")
    quiet = [a for a in EXTRACT_ARGS if a != "--no-progress"]
    tool.extract([str(tmp_path / "in"), str(tmp_path / "out"), "--workers", "0"] + quiet)
    err = capsys.readouterr().err
    assert "extracting" in err and "100%" in err  # rich's bar, run to its end
    again = tool.extract([str(tmp_path / "in"), str(tmp_path / "out"), "--workers", "0", "--no-progress"] + quiet)
    assert again["resumed"] == 8 and "extracting" not in capsys.readouterr().err
