"""Every installed console script on a plain install (issue #36): the wheel ``pip install``-ed
into a fresh venv that has torch and the package's own requirements only (no mmdet, mmseg,
mmcv, timm, torchvision). Each entry point runs as a subprocess, does what it can, says in one
line what it skipped and why, and exits 0.

Installing torch afresh costs gigabytes, so the venv borrows the running environment's
*installed distributions* of exactly the package's requirement closure (torch and its
dependencies, mmengine and its, numpy, Pillow, safetensors): a folder of links to those
distributions' files and ``*.dist-info`` (found from their RECORDs), put on the venv's path by a
``.pth`` file. Nothing else of the running environment is visible there (checked), and
``pip check`` in the venv sees the requirements met. The wheel goes in with ``--no-deps
--no-index`` (the running pip, ``--python`` the venv's): nothing is downloaded.
"""
from __future__ import annotations

import configparser
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from ..packaging import ROOT, last, run

pytestmark = pytest.mark.install

#: What a plain install must not have (the peers the tools compare with, the OpenMMLab libraries).
ABSENT = ("mmdet", "mmseg", "mmcv", "timm", "torchvision", "transformers")
SMALL = ["--embed-dims", "16", "--depths", "1", "1", "1", "1", "--num-heads", "1", "2", "4", "8"]


def _requirements() -> list:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]


def closure(roots: list) -> dict:
    """Distribution name -> distribution, for ``roots`` and everything they require (markers
    evaluated for this machine, extras not taken)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict = {}
    todo = list(roots)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{req.name} (required by the package's install closure) is not installed here")
        found[name] = dist
        todo.extend(dist.requires or [])
    return found


def link_distributions(dists: dict, folder: str) -> None:
    """Links in ``folder`` to every top-level file / package folder and dist-info of ``dists``."""
    site = sysconfig.get_paths()["purelib"]
    os.makedirs(folder)
    for dist in dists.values():
        tops = {str(f).split("/")[0] for f in (dist.files or []) if not str(f).startswith("..")}
        if not dist.files:
            tops |= set((dist.read_text("top_level.txt") or "").split())
        for top in tops:
            src = os.path.join(str(dist.locate_file("")), top)
            dst = os.path.join(folder, top)
            if os.path.exists(src) and not os.path.lexists(dst) and not top.endswith(".pth"):
                os.symlink(src, dst)
    assert os.path.isdir(os.path.join(folder, "torch")), f"torch not found under {site}"


@pytest.fixture(scope="module")
def plain_venv(wheel, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("plain")
    venv = str(tmp / "venv")
    # No pip / setuptools of the venv's own (they would shadow the linked ones): the running pip
    # installs into it (``pip --python``).
    run([sys.executable, "-m", "venv", "--without-pip", venv], str(tmp))
    python = os.path.join(venv, "bin", "python")
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], str(tmp)).strip()
    linked = str(tmp / "linked")
    link_distributions(closure(_requirements()), linked)
    with open(os.path.join(purelib, "linked_requirements.pth"), "w") as f:
        f.write(linked + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", "install", "-q",
         "--no-deps", "--no-index", wheel], str(tmp))
    work = tmp / "work"
    work.mkdir()
    return python, str(work)


def script_run(python: str, work: str, name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run an installed console script from the venv's bin, in a clean environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    return subprocess.run([os.path.join(os.path.dirname(python), name), *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_venv_is_a_plain_install(plain_venv):
    python, work = plain_venv
    out = run([python, "-c", textwrap.dedent(f"""
        import importlib.util, json, sys
        import torch, swin_backbone
        print('JSON ' + json.dumps(dict(
            present=[m for m in {ABSENT!r} if importlib.util.find_spec(m) is not None],
            package=swin_backbone.__file__.startswith(sys.prefix), torch=torch.__version__)))
    """)], work)
    result = json.loads(last(out, "JSON "))
    assert result["present"] == [] and result["package"]
    run([sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", "check"], work)  # all met


def test_every_console_script_runs_and_exits_0(plain_venv):
    python, work = plain_venv
    scripts = run([python, "-c", "import importlib.metadata as m; print('SCRIPTS', sorted(e.name for e in "
                   "m.distribution('swin-backbone').entry_points if e.group == 'console_scripts'))"], work)
    # Each installed entry point is run below: a new one fails here until it is covered.
    assert last(scripts, "SCRIPTS ") == str(["swin-benchmark", "swin-buckets", "swin-convert-checkpoint",
                                             "swin-extract-features", "swin-make-toy-data", "swin-test", "swin-train"])
    run([python, "-c", textwrap.dedent("""
        import numpy as np, torch
        from PIL import Image
        from swin_backbone import SwinBackbone
        m = SwinBackbone(arch=None, embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8))
        torch.save(m.state_dict(), 'small.pth')
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save('a.png')
    """)], work)

    proc = script_run(python, work, "swin-convert-checkpoint", "small.pth", "small_mmdet.pth", "--to", "mmdet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote small_mmdet.pth (mmdet layout, " in proc.stdout

    proc = script_run(python, work, "swin-extract-features", "a.png", "feats", "--checkpoint", "small_mmdet.pth",
                      *SMALL, "--no-progress", "--workers", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 1 images" in proc.stdout and os.path.isfile(os.path.join(work, "feats", "a.npz"))

    # The benchmark without any peer: ours alone, one line naming every comparison it skipped.
    proc = script_run(python, work, "swin-benchmark", "--device", "cpu", "--iters", "1", "--warmup", "0",
                      "--size", "64", "64")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("skipped (not installed): ")]
    assert len(skipped) == 1, proc.stdout
    for lib in ("mmdet", "timm", "torchvision"):
        assert f": {lib} (pip install " in skipped[0], skipped[0]
    assert "eval fp32 1x3x64x64: ours " in proc.stdout and "No module named" not in proc.stdout + proc.stderr
    assert "train fwd+bwd fp32 2x3x64x64: ours " in proc.stdout

    # The toy data needs numpy and Pillow only; training and testing need mmdet / mmseg, and say so.
    proc = script_run(python, work, "swin-make-toy-data", "--out", "data", "--which", "coco", "--num-train", "2",
                      "--num-val", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isfile(os.path.join(work, "data", "toy_coco", "annotations", "instances_val2017.json"))
    for name, args in (("swin-train", []), ("swin-test", ["none.pth"]), ("swin-buckets", [])):
        proc = script_run(python, work, name, "swin_backbone::toy/mask-rcnn_swin-toy_fpn_toy-coco.py", *args)
        error = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(error) == 1, proc.stderr[-3000:]
        assert "mmdet is not installed: pip install 'swin-backbone[mmdet-lite]'" in error[0], error
