"""swin-buckets (swin_backbone/tools/buckets.py) on the shipped configs: the batches it draws are
the ones mmdet builds (padded to the divisor, holding their images, grouped by orientation), the
shipped bucket sets hold every drawn batch, ``--pick`` holds them all, and the bucket configs load
with their keys. A few hundred draws each: seconds."""
import json
import os
import pytest
from mmengine.config import Config

from swin_backbone.buckets import choose_bucket, oriented
from swin_backbone.tools import buckets as tool

from ..helpers import CONFIG_ROOT

DET = {  # shipped recipe -> its buckets + CUDA graphs variant
    "1x": ("mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py",
           "mmdet/mask-rcnn_swin-t-p4-w7_fpn_buckets-cudagraphs_1x_coco.py"),
    "3x": ("mmdet/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py",
           "mmdet/mask-rcnn_swin-t-p4-w7_fpn_buckets-cudagraphs_ms-crop-3x_coco.py"),
}
NEW_CONFIGS = [
    "mmdet/mask-rcnn_swin-t-p4-w7_fpn_buckets-cudagraphs_1x_coco.py",
    "mmdet/retinanet_swin-t-p4-w7_fpn_buckets-cudagraphs_1x_coco.py",
    "mmdet/mask-rcnn_swin-t-p4-w7_fpn_buckets-cudagraphs_ms-crop-3x_coco.py",
    "mmdet/cascade-mask-rcnn_swin-t-p4-w7_fpn_buckets-cudagraphs_ms-crop-3x_coco.py",
    "mmseg/upernet_swin-t_cudagraphs_512x512_160k_ade20k.py",
    "mmseg/upernet_swin-s_cudagraphs_512x512_160k_ade20k.py",
    "mmseg/upernet_swin-b_cudagraphs_512x512_160k_ade20k.py",
]
WHOLE_CUDA_GRAPHS = {"mode": "reduce-overhead", "dynamic": False, "regions": False}


@pytest.fixture(scope="module")
def drawn():
    """``{recipe: (batches, settings, shipped buckets)}``: 300 batches of each recipe."""
    out = {}
    for recipe, (base, variant) in DET.items():
        cfg = Config.fromfile(os.path.join(CONFIG_ROOT, base))
        batches, info = tool.draw_batches(cfg, draws=300, seed=1)
        out[recipe] = batches, info, Config.fromfile(os.path.join(CONFIG_ROOT, variant)).model.data_preprocessor.buckets
    return out


@pytest.mark.parametrize("recipe", sorted(DET))
def test_drawn_batches_are_padded_to_the_divisor_and_hold_their_images(drawn, recipe):
    batches, info, _ = drawn[recipe]
    assert info["batch_size"] == 2 and info["grouped"] and info["divisor"] == 32
    assert len(batches) == 300
    for (h, w), images in batches:
        assert len(images) == 2 and h % 32 == 0 and w % 32 == 0
        assert h - 32 < max(i[0] for i in images) <= h and w - 32 < max(i[1] for i in images) <= w
        assert all(max(i) <= 1333 and min(i) <= 800 for i in images)  # the recipes' resize (1333, 800)
    if recipe == "1x":  # resizing keeps orientation: grouped batches are all landscape or all portrait
        assert all(len({i[1] >= i[0] for i in images}) == 1 for _, images in batches)
        assert {min(i) for _, images in batches for i in images} <= set(range(600, 801))
    else:  # multi-scale: short sides 480..800, many shapes
        assert len({s for s, _ in batches}) > 30


@pytest.mark.parametrize("recipe", sorted(DET))
def test_shipped_buckets_hold_every_batch(drawn, recipe):
    batches, _, buckets = drawn[recipe]
    summary = tool.summarize(batches, buckets)
    plain = tool.summarize(batches)
    assert summary["misfit_batches"] == 0 and summary["misfit_shapes"] == []
    assert summary["captures"] <= 2 * len(buckets) < plain["shapes"]
    assert summary["padding_buckets"] >= plain["padding"] == summary["padding"] > 0
    used = {choose_bucket(*shape, buckets) for shape, _ in batches}
    assert len(used) == summary["captures"] and used <= set(oriented(buckets))


def test_one_bucket_misses_the_3x_recipes_mixed_batches(drawn):
    # A portrait crop in a landscape batch: some 3x batches are taller than 800 and wider than 800.
    summary = tool.summarize(drawn["3x"][0], [(800, 1344)])
    assert summary["misfit_batches"] > 0 and all(min(s) > 800 for s in summary["misfit_shapes"])


def test_pick_holds_every_batch_at_least_padding():
    batches = [((800, 1088), ((800, 1067), (800, 1000)))] * 5 + [((1216, 800), ((1199, 800), (1100, 760)))] * 3 + [
        ((800, 1344), ((750, 1333), (800, 1300)))]
    assert tool.pick(batches, 1) == [(800, 1344)]
    assert tool.pick(batches, 2) == [(800, 1088), (800, 1344)]
    assert tool.pick(batches, 3) == [(800, 1088), (800, 1216), (800, 1344)]
    assert tool.pick(batches, 2, bound=(1344, 1344)) == [(800, 1216), (1344, 1344)]
    with pytest.raises(ValueError, match="--bound 800x1216: smaller than the drawn batches"):
        tool.pick(batches, 2, bound=(800, 1216))


def test_pick_and_json(tmp_path, capsys):
    out = tmp_path / "b.json"
    tool.main([DET["3x"][0], "--draws", "200", "--pick", "3", "--bound", "1344x1344", "--json", str(out)])
    stdout = capsys.readouterr().out
    result = json.loads(out.read_text())
    picked = result["picked"]
    assert len(picked["buckets"]) == 3 and [1344, 1344] in picked["buckets"]
    assert picked["misfit_batches"] == 0 and picked["batches"] == 200
    assert picked["captures"] <= 5 < result["unbucketed"]["shapes"]
    assert result["unbucketed"]["padding"] <= picked["padding_buckets"] < 1
    assert (result["batch_size"], result["grouped"], result["divisor"], result["sizes"]) == (2, True, 32, "COCO_LIKE")
    listed = ", ".join(f"({h}, {w})" for h, w in picked["buckets"])
    line = f"model = dict(data_preprocessor=dict(buckets=[{listed}]))"
    assert line in stdout
    assert "batch shapes / captures" in stdout and "padding share" in stdout and "picked 3" in stdout


def test_buckets_from_a_config_and_the_ann_file(tmp_path, capsys):
    ann = tmp_path / "ann.json"
    images = [{"id": 1, "width": 640, "height": 480}, {"id": 2, "width": 480, "height": 640}]
    ann.write_text(json.dumps({"images": images}))
    out = tmp_path / "b.json"
    tool.main(["mask-rcnn_swin-t-p4-w7_fpn_1x_coco", "--draws", "20", "--ann-file", str(ann), "--json", str(out),
               "--buckets-from", DET["1x"][1]])
    result = json.loads(out.read_text())
    assert result["given"]["buckets"] == [[800, 1344]]
    # 640x480 -> 1067x800 (keep ratio, 800 short side) -> padded 800x1088 -> the bucket 800x1344
    assert result["unbucketed"]["shapes"] == 2 and result["given"]["captures"] == 2
    image, batch = 1067 * 800, 800 * 1344
    assert result["given"]["padding_buckets"] == pytest.approx(1 - image / batch, abs=1e-3)
    assert result["given"]["padding_buckets"] > result["unbucketed"]["padding"]
    assert "buckets 800x1344" in capsys.readouterr().out


def test_test_split_is_in_order_one_image_per_batch():
    cfg = Config.fromfile(os.path.join(CONFIG_ROOT, DET["1x"][0]))
    batches, info = tool.draw_batches(cfg, split="test", draws=50)
    assert info["batch_size"] == 1 and not info["grouped"]
    assert all(len(images) == 1 for _, images in batches)


def test_bad_buckets_is_an_error_naming_the_argument(capsys):
    with pytest.raises(SystemExit) as err:
        tool.main([DET["1x"][0], "--buckets", "800x1344", "800by1344"])
    assert err.value.code == 2
    expected = "argument --buckets: expected HEIGHTxWIDTH in pixels (e.g. 800x1344), got '800by1344'"
    assert expected in capsys.readouterr().err


def test_missing_config_is_one_line(capsys):
    with pytest.raises(SystemExit) as err:
        tool.main(["mmdet/no-such-config.py", "--draws", "1"])
    assert "config 'mmdet/no-such-config.py': no such file" in str(err.value)


@pytest.mark.parametrize("name", NEW_CONFIGS)
def test_bucket_configs_load_with_their_keys(name):
    cfg = Config.fromfile(os.path.join(CONFIG_ROOT, name))
    shipped = name.replace("_buckets-cudagraphs", "").replace("_cudagraphs", "")
    base = Config.fromfile(os.path.join(CONFIG_ROOT, shipped))
    assert cfg.model.backbone.compile == WHOLE_CUDA_GRAPHS
    assert cfg.model.backbone.type == "SwinBackbone" and cfg.model.backbone.arch == base.model.backbone.arch
    assert cfg.model.data_preprocessor.type == base.model.data_preprocessor.type  # merged, not replaced
    assert cfg.model.data_preprocessor.mean == base.model.data_preprocessor.mean
    if name.startswith("mmdet/"):
        buckets = cfg.model.data_preprocessor.buckets
        assert buckets and all(h % 32 == 0 and w % 32 == 0 for h, w in buckets)
        assert cfg.model.data_preprocessor.pad_size_divisor == 32
    else:
        assert cfg.model.test_cfg == {"mode": "slide", "crop_size": (512, 512), "stride": (341, 341)}
        assert cfg.model.data_preprocessor.size == (512, 512)
