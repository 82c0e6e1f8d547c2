"""Hostile arguments of tools/train.py and tools/test.py: a bad config path or checkpoint
is one line naming it (``SystemExit`` with the message: exit status 1), before a Runner is
built; a checkpoint of another architecture is refused instead of evaluating random weights
(README: a checkpoint that matches less than half of the model is an error)."""
import os
import subprocess
import sys

import pytest
import torch

from swin_backbone import SwinBackbone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEG = os.path.join(ROOT, "configs", "toy", "upernet_swin-toy_toy-ade.py")
DET = os.path.join(ROOT, "configs", "toy", "mask-rcnn_swin-toy_fpn_toy-coco.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    (root / "broken.py").write_text("model = dict(type='X'\n")
    (root / "no_scope.py").write_text("model = dict(type='X')\n")
    (root / "a_folder").mkdir()
    (root / "file.txt").write_text("x")
    ckpt = root / "ok.pth"
    torch.save({"state_dict": {}}, ckpt)
    return root


def _tool(name):
    from swin_backbone.tools import test as test_tool
    from swin_backbone.tools import train as train_tool

    return {"test": test_tool, "train": train_tool}[name]


ROWS = [
    # (id, tool, argv with {root}, words of the one-line message)
    ("test-config-missing", "test", "{root}/none.py {root}/ok.pth", ["config", "no such file"]),
    ("test-config-folder", "test", "{root}/a_folder {root}/ok.pth", ["config", "a folder"]),
    ("test-config-syntax-error", "test", "{root}/broken.py {root}/ok.pth", ["broken.py", "cannot be read"]),
    ("test-config-without-scope", "test", "{root}/no_scope.py {root}/ok.pth", ["default_scope", "mmdet"]),
    ("test-checkpoint-missing", "test", SEG + " {root}/none.pth", ["checkpoint", "no such file"]),
    ("test-checkpoint-folder", "test", SEG + " {root}/a_folder", ["checkpoint", "a folder"]),
    ("test-work-dir-is-a-file", "test", SEG + " {root}/ok.pth --work-dir {root}/file.txt", ["--work-dir", "a file"]),
    ("test-out-not-pickle", "test", DET + " {root}/ok.pth --out {root}/preds.json", ["--out", ".pkl"]),
    ("test-seg-out-is-a-file", "test", SEG + " {root}/ok.pth --out {root}/file.txt", ["--out", "folder"]),
    ("train-config-missing", "train", "{root}/none.py", ["config", "no such file"]),
    ("train-config-folder", "train", "{root}/a_folder", ["config", "a folder"]),
    ("train-resume-missing", "train", SEG + " --resume {root}/none.pth", ["--resume", "no such checkpoint"]),
    ("train-work-dir-is-a-file", "train", SEG + " --work-dir {root}/file.txt", ["--work-dir", "a file"]),
]


@pytest.mark.parametrize("tool,argv,says", [pytest.param(t, a, s, id=i) for i, t, a, s in ROWS])
def test_tool_row(files, tool, argv, says):
    if "toy" in argv:
        pytest.importorskip("mmseg" if argv.startswith(SEG) else "mmdet")
    with pytest.raises(SystemExit) as exit_:
        _tool(tool).main(argv.format(root=files).split())
    message = exit_.value.code
    assert isinstance(message, str) and "\n" not in message.strip(), message  # one line, exit status 1
    for word in says:
        assert word.lower() in message.lower(), (word, message)


@pytest.mark.parametrize("tool,argv", [("test", "{root}/x.py {root}/ok.pth --launcher mars"),
                                       ("train", "{root}/x.py --cfg-options")])
def test_tool_usage_errors_exit_2(files, tool, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        _tool(tool).main(argv.format(root=files).split())
    assert exit_.value.code == 2


# ---------------------------------------------------------------------------------- checkpoint match
def _toy_segmentor():
    pytest.importorskip("mmseg")
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    import swin_backbone  # noqa: F401
    from mmseg.registry import MODELS

    os.environ.setdefault("TOY_DATA_ROOT", "data")
    init_default_scope("mmseg")
    cfg = Config.fromfile(SEG)
    return MODELS.build(cfg.model)


class _Holder:
    """What require_checkpoint_match reads of a Runner: its (possibly wrapped) model."""

    def __init__(self, model):
        self.model = model


def test_checkpoint_match_accepts_the_models_own_weights_and_refuses_another_architecture(tmp_path):
    from mmengine.runner.checkpoint import load_checkpoint

    from swin_backbone.mmlab.runner import CheckpointMismatchError, require_checkpoint_match

    model = _toy_segmentor()
    own = tmp_path / "own.pth"
    torch.save({"state_dict": model.state_dict()}, own)
    other = _toy_segmentor()
    require_checkpoint_match(_Holder(other), str(own))
    load_checkpoint(other, str(own))  # mmengine's loading, as the Runner's load_from: all of it fits
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)

    # a backbone-only ImageNet-style checkpoint (official keys at the root): nothing of the segmentor
    backbone = SwinBackbone(arch=None, embed_dims=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    classification = tmp_path / "swin_classification.pth"
    torch.save({"model": {k: v for k, v in backbone.state_dict().items()}}, classification)
    victim = _toy_segmentor()
    require_checkpoint_match(_Holder(victim), str(classification))
    with pytest.raises(CheckpointMismatchError, match=r"swin_classification\.pth.*only 0 of its \d+ tensors"):
        load_checkpoint(victim, str(classification))

    # another size of the same detector family: every backbone tensor of another shape
    wide = SwinBackbone(arch=None, embed_dims=48, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    state = {f"backbone.{k}": v for k, v in wide.state_dict().items()}
    state.update({k: v for k, v in model.state_dict().items() if not k.startswith("backbone.")})
    wider = tmp_path / "wider.pth"
    torch.save({"state_dict": state}, wider)
    victim = _toy_segmentor()
    require_checkpoint_match(_Holder(victim), str(wider))
    with pytest.raises(CheckpointMismatchError, match=r"backbone: \d+ of \d+.*of another shape"):
        load_checkpoint(victim, str(wider))


@pytest.mark.slow  # tools/make_toy_data.py and tools/test.py as subprocesses
def test_tools_test_py_refuses_a_checkpoint_of_another_architecture(tmp_path):
    pytest.importorskip("mmseg")
    data = tmp_path / "data"
    subprocess.run([sys.executable, "tools/make_toy_data.py", "--out", str(data), "--num-train", "2",
                    "--num-val", "2", "--seed", "3"], check=True, cwd=ROOT, capture_output=True)
    backbone = SwinBackbone(arch=None, embed_dims=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    ckpt = tmp_path / "swin_classification.pth"
    torch.save({"model": backbone.state_dict()}, ckpt)
    env = dict(os.environ, TOY_DATA_ROOT=str(data), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "tools/test.py", SEG, str(ckpt), "--work-dir", str(tmp_path / "w"),
                           "--cfg-options", "test_dataloader.num_workers=0", "test_dataloader.persistent_workers=False"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tools/test.py: error: checkpoint") and "random weights" in last, last
    assert "Iter(test)" not in proc.stdout + proc.stderr  # not one test batch ran
