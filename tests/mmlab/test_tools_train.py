"""tools/train.py, --resume, tools/test.py and dist_train.sh on the toy datasets (real
mmengine Runner, real COCO / mIoU evaluation), a few iterations each."""
import glob
import os
import subprocess
import sys

import pytest

from ..helpers import FAST, ROOT, free_port, iters, run_tool, scalars

DET = "configs/toy/mask-rcnn_swin-toy_fpn_toy-coco.py"
SEG = "configs/toy/upernet_swin-toy_toy-ade.py"


def test_make_toy_data_is_deterministic_and_coco_valid(tmp_path):
    from pycocotools.coco import COCO

    for run in ("a", "b"):
        subprocess.run([sys.executable, "tools/make_toy_data.py", "--out", str(tmp_path / run), "--num-train", "3",
                        "--num-val", "2"], check=True, cwd=ROOT, capture_output=True)
    for rel in ["toy_coco/annotations/instances_train2017.json", "toy_coco/train2017/000002.jpg",
                "toy_ade/ADEChallengeData2016/annotations/validation/ADE_valid_00000002.png"]:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    coco = COCO(str(tmp_path / "a" / "toy_coco/annotations/instances_train2017.json"))
    assert len(coco.getImgIds()) == 3 and len(coco.getCatIds()) == 3
    ann = coco.loadAnns(coco.getAnnIds())[0]
    mask = coco.annToMask(ann)
    assert mask.sum() > 0.5 * ann["area"]


@pytest.mark.parametrize("config,metric", [(DET, "coco/bbox_mAP"), (SEG, "mIoU")])
def test_train_resume_and_test(tmp_path, toy_data, config, metric):
    work = str(tmp_path / "work")
    run_tool([sys.executable, "tools/train.py", config, "--work-dir", work, "--cfg-options", *FAST, *iters(4)], toy_data)
    assert os.path.isfile(os.path.join(work, "iter_4.pth"))
    assert any(metric in row for row in scalars(work))
    # resume from the latest checkpoint and train on to iteration 6
    out = run_tool([sys.executable, "tools/train.py", config, "--work-dir", work, "--resume", "--cfg-options", *FAST,
                    *iters(6)], toy_data)
    assert "resumed" in out.lower() and "iter_4.pth" in out
    assert os.path.isfile(os.path.join(work, "iter_6.pth"))
    # evaluate the checkpoint with the real metric
    test_work = str(tmp_path / "test")
    run_tool([sys.executable, "tools/test.py", config, os.path.join(work, "iter_6.pth"), "--work-dir", test_work,
              "--cfg-options", *FAST[2:6]], toy_data)
    assert any(metric in row for row in scalars(test_work))


def test_dist_train_two_processes_on_cpu(tmp_path, toy_data):
    work = str(tmp_path / "dist")
    run_tool(["bash", "tools/dist_train.sh", DET, "2", "--work-dir", work, "--cfg-options", *FAST, *iters(2)],
             toy_data, extra_env={"PYTHON": sys.executable, "PORT": str(free_port())})
    assert os.path.isfile(os.path.join(work, "iter_2.pth"))
    logs = open(glob.glob(os.path.join(work, "*", "*.log"))[0]).read()
    assert "Distributed launcher: pytorch" in logs or "distributed: True" in logs.lower()
