"""Images read exactly as mmdet's pipeline reads them (issue 28): the extraction tool's input
tensor for a file equals the one mmdet's test pipeline (the shipped config's LoadImageFromFile
and PackDetInputs) and data preprocessor give the backbone, for the files phones and scanners
produce: an EXIF-rotated JPEG, a palette PNG, an RGBA PNG, 16-bit PNGs, a grayscale and a CMYK
JPEG. The Pillow fallback (no mmcv) applies the same conversions."""
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from swin_backbone.features import FeatureExtractor
from swin_backbone.tools.extraction import ImageReadError, LoaderSettings, decode_pil, loader_settings, read_rgb
from swin_backbone.tools import extract_features as tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DET_CONFIG = os.path.join(ROOT, "configs", "mmdet", "mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py")


def _scene(h=36, w=52):
    """An image whose orientation and channels are unmistakable: a bright red top-left block."""
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([(xx * 255 // w), (yy * 255 // h), np.full((h, w), 90)], 2).astype(np.uint8)
    rgb[:8, :12] = (250, 10, 10)
    return rgb


def write_files(folder):
    """The hostile-but-valid image files; name -> what the pixels must be (upright RGB), or
    None where only mmcv's own answer defines them."""
    os.makedirs(folder, exist_ok=True)
    rgb = _scene()
    expected = {}
    # EXIF orientation 6 (rotate 90 CW to view): store the image turned the other way
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.rot90(rgb, 1).copy()).save(os.path.join(folder, "exif_rotated.jpg"), quality=98,
                                                  exif=exif.tobytes())
    expected["exif_rotated.jpg"] = ("jpeg", rgb)
    pal = Image.fromarray(rgb).convert("P", palette=Image.ADAPTIVE, colors=16)
    pal.info["transparency"] = 0
    pal.save(os.path.join(folder, "palette.png"), transparency=0)
    expected["palette.png"] = ("exact", np.asarray(pal.convert("RGB")))
    rgba = np.concatenate([rgb, np.linspace(0, 255, rgb.shape[1], dtype=np.uint8)[None, :, None].repeat(
        rgb.shape[0], 0)], 2)
    Image.fromarray(rgba, "RGBA").save(os.path.join(folder, "rgba.png"))
    expected["rgba.png"] = ("exact", rgb)  # alpha dropped, not composited (as OpenCV)
    grey16 = (np.arange(36 * 52).reshape(36, 52) * 35).astype(np.uint16)  # 0 .. 65485
    Image.fromarray(grey16).save(os.path.join(folder, "grey16.png"))
    expected["grey16.png"] = ("exact", np.repeat((grey16 >> 8).astype(np.uint8)[:, :, None], 3, 2))
    Image.fromarray(rgb).convert("L").save(os.path.join(folder, "grey.jpg"), quality=98)
    expected["grey.jpg"] = ("jpeg", np.repeat(np.asarray(Image.fromarray(rgb).convert("L"))[:, :, None], 3, 2))
    Image.fromarray(rgb).convert("CMYK").save(os.path.join(folder, "cmyk.jpg"), quality=98)
    expected["cmyk.jpg"] = ("cmyk", rgb)
    return expected


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("phone_images"))
    return folder, write_files(folder)


def _close(actual, expected, kind):
    assert actual.shape == expected.shape and actual.dtype == np.uint8
    diff = np.abs(actual.astype(int) - expected.astype(int))
    if kind == "exact":
        assert diff.max() == 0
    else:  # lossy JPEG (CMYK: the colour conversion too)
        assert diff.mean() < (12 if kind == "cmyk" else 4), diff.mean()


# ---------------------------------------------------------------------------------- Pillow fallback
@pytest.mark.parametrize("name", ["exif_rotated.jpg", "palette.png", "rgba.png", "grey16.png", "grey.jpg", "cmyk.jpg"])
def test_pillow_reader_gives_upright_rgb_with_the_loaders_conversions(files, name):
    folder, expected = files
    kind, pixels = expected[name]
    image = read_rgb(os.path.join(folder, name), reader="pil")
    _close(image, pixels, kind)


def test_pillow_reader_16_bit_png_is_not_saturated(files):
    folder, _ = files
    image = read_rgb(os.path.join(folder, "grey16.png"), reader="pil")
    naive = np.asarray(Image.open(os.path.join(folder, "grey16.png")).convert("RGB"))
    assert (naive == 255).mean() > 0.9  # what the old code read: white
    assert image.min() == 0 and image.max() == 255 and (image == 255).mean() < 0.05


def test_pillow_reader_refuses_what_it_cannot_decode(tmp_path):
    (tmp_path / "cut.jpg").write_bytes(open(os.path.join(ROOT, "README.md"), "rb").read()[:100])
    with pytest.raises(ImageReadError, match="cut.jpg: Pillow cannot decode it"):
        read_rgb(str(tmp_path / "cut.jpg"), reader="pil")
    good = io.BytesIO()
    Image.fromarray(_scene()).save(good, format="JPEG")
    with pytest.raises(ImageReadError, match="(?i)half.jpg.*truncated"):
        decode_pil(good.getvalue()[: len(good.getvalue()) // 2], source="half.jpg")


# ---------------------------------------------------------------------------------- mmcv = mmdet
def _mmdet_backbone_inputs(paths):
    """What mmdet's test pipeline (the shipped config's, without Resize) and the model's data
    preprocessor give the backbone for each file, cropped to the image."""
    pytest.importorskip("mmdet")
    from mmengine.config import Config
    from mmengine.dataset import Compose
    from mmengine.registry import init_default_scope

    from mmdet.registry import MODELS

    cfg = Config.fromfile(DET_CONFIG)
    init_default_scope("mmdet")
    steps = [s for s in cfg.test_pipeline if s["type"] in ("LoadImageFromFile", "PackDetInputs")]
    assert [s["type"] for s in steps] == ["LoadImageFromFile", "PackDetInputs"]
    pipeline = Compose(steps)
    preprocessor = MODELS.build(cfg.model.data_preprocessor)
    out = []
    for i, path in enumerate(paths):
        packed = pipeline(dict(img_path=path, img_id=i))
        batch = preprocessor(dict(inputs=[packed["inputs"]], data_samples=[packed["data_samples"]]), False)
        h, w = packed["inputs"].shape[-2:]
        out.append(batch["inputs"][0, :, :h, :w])
    return out, loader_settings(cfg)


def test_the_tools_input_tensor_is_mmdets(files, tmp_path):
    pytest.importorskip("mmcv")
    folder, expected = files
    names = sorted(expected)
    paths = [os.path.join(folder, n) for n in names]
    theirs, settings = _mmdet_backbone_inputs(paths)
    assert settings == LoaderSettings()  # the shipped config reads with mmcv's defaults
    plan = tool.OutputPlan(str(tmp_path), folder, "npz", {0: 16})
    jobs = tool.ImageJobs(paths, plan, None, skip_complete=False, pooled=None, reader="mmcv", loader=settings)
    fx = FeatureExtractor(torch.nn.Identity())  # (the default mean / std are the config's)
    for i, name in enumerate(names):
        item = jobs[i]
        assert item["status"] == "ok", item
        ours = fx.preprocess([item["image"]])[0]
        assert ours.shape == theirs[i].shape, name
        torch.testing.assert_close(ours, theirs[i], rtol=0, atol=1e-5, msg=name)
        kind, pixels = expected[name]
        _close(item["image"].permute(1, 2, 0).numpy(), pixels, kind)  # and it is the upright picture


def test_pillow_fallback_is_close_to_mmcv(files):
    pytest.importorskip("mmcv")
    folder, expected = files
    for name, (kind, _) in expected.items():
        path = os.path.join(folder, name)
        _close(read_rgb(path, reader="pil"), read_rgb(path, reader="mmcv"), kind)


def test_files_mmcv_refuses_are_listed_as_failed_with_the_reason(tmp_path):
    pytest.importorskip("mmcv")
    src = tmp_path / "in"
    src.mkdir()
    (src / "fake.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    Image.fromarray(_scene()).save(src / "good.png")
    summary = tool.extract([str(src), str(tmp_path / "out"), "--reader", "mmcv", "--embed-dims", "16", "--depths",
                            "1", "1", "1", "1", "--num-heads", "1", "2", "4", "8", "--random-weights",
                            "--no-progress", "--workers", "0"])
    assert summary["images"] == 1 and summary["reader"].startswith("mmcv (cv2")
    (failed,) = summary["failed"]
    assert failed["image"].endswith("fake.png") and "mmcv (cv2) cannot decode it" in failed["error"]


def test_a_cut_off_jpeg_is_read_as_mmcv_reads_it_and_said(tmp_path):
    pytest.importorskip("mmcv")
    src = tmp_path / "in"
    src.mkdir()
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="JPEG")
    (src / "cut.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    import mmcv

    if mmcv.imfrombytes((src / "cut.jpg").read_bytes()) is None:
        pytest.skip("this OpenCV refuses cut-off JPEGs: the file is listed as failed like any other")
    summary = tool.extract([str(src), str(tmp_path / "out"), "--reader", "mmcv", "--embed-dims", "16", "--depths",
                            "1", "1", "1", "1", "--num-heads", "1", "2", "4", "8", "--random-weights",
                            "--no-progress", "--workers", "0"])
    assert summary["images"] == 1 and any("cut.jpg" in n and "end-of-image" in n for n in summary["notes"])
