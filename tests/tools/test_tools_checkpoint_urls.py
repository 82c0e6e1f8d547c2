"""The tools take a checkpoint URL as they take a file (issue #36): swin-convert-checkpoint,
swin-extract-features --checkpoint and tools/test.py, each against a real HTTP server on
127.0.0.1 (one download, then the torch hub cache under ``$TORCH_HOME``)."""
import hashlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from swin_backbone import SwinBackbone, load_checkpoint
from swin_backbone.checkpoint.remote import cached_file
from swin_backbone.tools import extract_features as tool
from swin_backbone.tools.convert_checkpoint import main as convert_main

from ..checkpoint.loopback import server, torch_home  # noqa: F401 (fixtures)
from ..helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("one_thread")


def _served_model(server, path):
    src = SwinBackbone(**TINY).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(std=0.2)
    buf = io.BytesIO()
    torch.save({"state_dict": src.state_dict()}, buf)
    return src, server.serve(path, buf.getvalue())


def test_convert_tool_reads_a_url(server, torch_home, tmp_path, capsys):
    src, url = _served_model(server, "/models/swin_small_test.pth")
    for name in ("a.pth", "b.pth"):
        assert convert_main([url, str(tmp_path / name), "--to", "mmdet"]) == 0
        assert f"wrote {tmp_path / name} (mmdet layout, " in capsys.readouterr().out
    assert server.requests["/models/swin_small_test.pth"] == 1
    back = SwinBackbone(**TINY)
    load_checkpoint(back, str(tmp_path / "b.pth"), strict=True, logger=None)
    for key, value in src.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert convert_main([server.url("/models/none.pth"), str(tmp_path / "c.pth")]) == 1
    err = capsys.readouterr().err
    assert "HTTP 404" in err and len(err.strip().splitlines()) == 1


def test_extract_tool_checkpoint_url(server, torch_home, tmp_path):
    src, url = _served_model(server, "/models/swin_extract_test.pth")
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (40, 56, 3), dtype=np.uint8)).save(images / "a.png")
    common = [str(images), str(tmp_path / "out"), "--embed-dims", "16", "--depths", "2", "2", "2", "2", "--num-heads",
              "1", "2", "2", "4", "--no-progress", "--workers", "0"]
    args = common + ["--checkpoint", url]
    summary = tool.extract(args)
    assert summary["images"] == 1 and not summary["failed"]
    settings = json.load(open(tmp_path / "out" / "settings.json"))["checkpoint"]
    with open(cached_file(url), "rb") as f:
        assert settings == dict(file=url, sha256=hashlib.sha256(f.read()).hexdigest())
    again = tool.extract(args)  # the same settings: resumes, reading the cache
    assert again["resumed"] == 1
    assert server.requests["/models/swin_extract_test.pth"] == 1
    with pytest.raises(SystemExit):  # a missing local file is still a usage error before anything runs
        tool.parse_args(common + ["--checkpoint", str(tmp_path / "none.pth")])


@pytest.mark.slow  # tools/make_toy_data.py and tools/test.py as subprocesses
def test_tools_test_py_with_a_checkpoint_url(server, tmp_path, monkeypatch):
    pytest.importorskip("mmseg")
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    import swin_backbone  # noqa: F401  (registration)

    seg = os.path.join(ROOT, "configs", "toy", "upernet_swin-toy_toy-ade.py")
    data = tmp_path / "data"
    subprocess.run([sys.executable, "tools/make_toy_data.py", "--out", str(data), "--num-train", "2",
                    "--num-val", "2", "--seed", "3"], check=True, cwd=ROOT, capture_output=True)
    monkeypatch.setenv("TOY_DATA_ROOT", str(data))
    init_default_scope("mmseg")
    model = MODELS.build(Config.fromfile(seg).model)
    buf = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "meta": {}}, buf)
    url = server.serve("/work_dirs/toy_upernet_iter_4.pth", buf.getvalue())
    env = dict(os.environ, TOY_DATA_ROOT=str(data), OMP_NUM_THREADS="1", TORCH_HOME=str(tmp_path / "torch_home"))
    proc = subprocess.run([sys.executable, "tools/test.py", seg, url, "--work-dir", str(tmp_path / "w"),
                           "--cfg-options", "test_dataloader.num_workers=0",
                           "test_dataloader.persistent_workers=False"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mIoU" in proc.stdout + proc.stderr
    assert os.path.isfile(tmp_path / "torch_home" / "hub" / "checkpoints" / "toy_upernet_iter_4.pth")
    assert server.requests["/work_dirs/toy_upernet_iter_4.pth"] == 1
