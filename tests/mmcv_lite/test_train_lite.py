"""tools/train.py on mmcv-lite: the toy Mask R-CNN and UPerNet train with ``--amp`` (bf16 on the
CPU, where compiled mmcv's CPU NMS refuses bf16), and, where compiled mmcv is installed (the
torch 2.1 stack), train a few iterations to the same losses and metrics both ways: compiled ops,
and mmcv-lite simulated in a subprocess by hiding ``mmcv._ext`` (tests/mmcv_lite/lite_mode.py)."""
import math
import os
import subprocess
import sys

import pytest
import torch

import swin_backbone  # noqa: F401,I001

from .common import compiled_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LITE_MODE = os.path.join("tests", "mmcv_lite", "lite_mode.py")
DET = "configs/toy/mask-rcnn_swin-toy_fpn_toy-coco.py"
SEG = "configs/toy/upernet_swin-toy_toy-ade.py"
METRIC = {DET: "coco/bbox_mAP", SEG: "mIoU"}
LOG_LINE = "has no compiled ops (mmcv-lite)"
#: Whether the model calls mmcv ops (the log line comes with the first one): Mask R-CNN's NMS and
#: RoIAlign; the UPerNet calls none.
CALLS_OPS = {DET: True, SEG: False}
#: End to end, compiled mmcv against mmcv-lite: each logged loss within this relative difference.
#: (Measured on the torch 2.1 stack: equal. NMS keeps the same boxes in the same order, ties
#: included, and torchvision's RoIAlign gives mmcv's values and gradients to the bit on the CPU;
#: the margin is for summation order elsewhere.)
LOSS_RTOL = 1e-5


def options(iters):
    loader = [f"{split}_dataloader.{key}" for split in ("train", "val", "test")
              for key in ("num_workers=0", "persistent_workers=False")]
    return loader + ["train_dataloader.batch_size=2", f"train_cfg.max_iters={iters}", f"train_cfg.val_interval={iters}",
                     f"default_hooks.checkpoint.interval={iters}", "default_hooks.logger.interval=1",
                     "randomness.seed=0"]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    subprocess.run([sys.executable, "tools/make_toy_data.py", "--out", str(root), "--num-train", "4", "--num-val", "2",
                    "--seed", "3"], check=True, cwd=ROOT, capture_output=True)
    return str(root)


def run(args, toy_data):
    env = dict(os.environ, TOY_DATA_ROOT=toy_data, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH")] if p)
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{out[-6000:]}"
    return out


def predict(config, checkpoint, out_file, toy_data, lite):
    """tools/test.py --out: the detector's predictions on the toy val images, every score kept."""
    import pickle

    run([sys.executable] + ([LITE_MODE] if lite else []) + ["tools/test.py", config, checkpoint, "--out", out_file,
         "--work-dir", os.path.dirname(out_file), "--cfg-options", "model.test_cfg.rcnn.score_thr=0.0"]
        + options(1)[:6], toy_data)
    with open(out_file, "rb") as f:
        return pickle.load(f)


def train(config, work_dir, toy_data, iters, lite, amp=False):
    """tools/train.py in a subprocess (through lite_mode.py for ``lite``): (training rows,
    validation metrics, output)."""
    from swin_backbone.tools.runner import read_metrics

    args = ([sys.executable] + ([LITE_MODE] if lite else []) + ["tools/train.py", config, "--work-dir", work_dir]
            + (["--amp"] if amp else []) + ["--cfg-options"] + options(iters))
    out = run(args, toy_data)
    rows = read_metrics(work_dir)
    train_rows = [r for r in rows if "loss" in r]
    metrics = [r for r in rows if METRIC[config] in r]
    assert len(train_rows) == iters and len(metrics) == 1, rows
    return train_rows, metrics[0], out


@pytest.mark.parametrize("config", [DET, SEG], ids=["mask-rcnn", "upernet"])
def test_amp_trains_on_mmcv_lite(tmp_path, toy_data, config):
    """``--amp`` on the CPU: bf16 autocast through RPN proposals (NMS), RoIAlign and the losses (with
    CUDA, tools/train.py trains there in fp16 with mmengine's AmpOptimWrapper)."""
    rows, metrics, out = train(config, str(tmp_path / "amp"), toy_data, 2, lite=True, amp=True)
    wrapper = "'AmpOptimWrapper'" if torch.cuda.is_available() else "'BF16AutocastOptimWrapper'"
    assert (LOG_LINE in out) == CALLS_OPS[config] and wrapper in out
    for row in rows:
        assert all(math.isfinite(v) for k, v in row.items() if k.startswith("loss")), row
    assert math.isfinite(metrics[METRIC[config]])


@pytest.mark.parametrize("config", [DET, SEG], ids=["mask-rcnn", "upernet"])
def test_compiled_and_lite_train_alike(tmp_path, toy_data, config):
    if compiled_ext() is None:
        pytest.skip("compiled mmcv is not installed here (mmcv-lite): runs on the torch 2.1 stack")
    full, full_metrics, full_out = train(config, str(tmp_path / "compiled"), toy_data, 3, lite=False)
    lite, lite_metrics, lite_out = train(config, str(tmp_path / "lite"), toy_data, 3, lite=True)
    assert LOG_LINE not in full_out and (LOG_LINE in lite_out) == CALLS_OPS[config]
    worst = 0.0
    for a, b in zip(full, lite):
        keys = sorted(k for k in a if k.startswith("loss"))
        assert keys == sorted(k for k in b if k.startswith("loss"))
        for k in keys:
            rel = abs(a[k] - b[k]) / max(abs(a[k]), 1e-6)
            worst = max(worst, rel)
            assert rel <= LOSS_RTOL, (a["step"], k, a[k], b[k])
    metric_keys = [k for k in full_metrics if "/" in k or k in ("mIoU", "aAcc", "mAcc")]
    assert metric_keys and {k: full_metrics[k] for k in metric_keys} == {k: lite_metrics[k] for k in metric_keys}
    print(f"{config}: worst relative loss difference {worst:.2e} over {len(full)} iterations; "
          f"{METRIC[config]} {full_metrics[METRIC[config]]} both ways")
    if config == DET:  # the untrained detector's mAP is 0 both ways: compare its predictions themselves
        ckpt = str(tmp_path / "compiled" / "iter_3.pth")
        a, b = (predict(config, ckpt, str(tmp_path / f"pred-{mode}" / "preds.pkl"), toy_data, lite=mode == "lite")
                for mode in ("compiled", "lite"))
        assert len(a) == len(b) > 0
        boxes = 0
        for x, y in zip(a, b):
            px, py = x["pred_instances"], y["pred_instances"]
            assert torch.equal(px["labels"], py["labels"]) and len(px["labels"]) > 0
            assert torch.allclose(px["bboxes"], py["bboxes"], rtol=0, atol=1e-3)
            assert torch.allclose(px["scores"], py["scores"], rtol=0, atol=1e-5)
            assert [m["counts"] for m in px["masks"]] == [m["counts"] for m in py["masks"]]
            boxes += len(px["labels"])
        print(f"{config}: the same {boxes} boxes, scores and masks on {len(a)} images both ways")
