"""The package as a user gets it: build the wheel, ``pip install`` it into a fresh venv that has
only torch, and use it there (no checkout on ``sys.path``).

1. the bare install (torch + install_requires): imports without torchvision / mmdet / mmseg,
   builds and runs SwinBackbone, ships the configs, runs the console scripts and
   ``python -m swin_backbone.tools.extract_features`` on one image;
2. installing into the environments users already have (the old stacks of ``make test``:
   torch 2.1.2 + mmcv 2.1.0 + mmdet 3.3 + mmseg 1.2, and torch 2.0.1): pip's plan
   (``--dry-run --report``) for the wheel and its ``[mmdet,mmseg]`` extras changes nothing
   of torch, its companions, numpy or the OpenMMLab libraries;
3. a fresh venv that has no mmcv: pip's plan for every extra holds no source build (nothing
   compiles: the plain extras ask for no mmcv, the ``-lite`` ones for the mmcv-lite wheel);
4. ``[mmdet-lite,mmseg-lite]`` (+ the torchvision built for torch) added to the fresh venv:
   mmdet's and mmseg's models import on mmcv-lite with our ops, SwinBackbone builds from both
   libraries' registries, a user config inheriting ours through the ``swin_backbone::`` scope
   loads and builds its detector / segmentor; then mmdet's and mmseg's own entry points (their
   apis and inferencers, and the installed ``mmdet/.mim/tools/train.py`` / ``test.py``) in both
   import orders, a plain mmdet model with nothing of ours imported, and the README's demo as a
   pip user runs it (``swin-make-toy-data``, ``swin-train``, ``swin-test``);
5. mmcv-lite's ``_ext`` finder, installed at interpreter start by the wheel's one-line ``.pth``
   from a wheel, an sdist and an editable install, on the oldest and newest Python declared, and
   removed by ``pip uninstall`` (bare venvs: no torch needed);
6. what the sdist and the wheel carry besides the code: the sdist the license, the README and
   docs/*.md (not docs/measurements) and everything the wheel is built from; both the license
   (License-File) and the project URLs in their metadata.

torch and torchvision come from the machine's local wheels (pip config), the rest from the
package index. Run alone: ``pytest -m install``; leave out: ``-m 'not install'``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch

from .packaging import ROOT, Venv, last, run

pytestmark = pytest.mark.install

with open(os.path.join(ROOT, "setup.py")) as _f:
    PTH_LINE = re.search(r'^PTH_LINE = "(import [^"]*)\\n"$', _f.read(), re.M).group(1) + "\n"
CONFIGS = os.path.join(ROOT, "swin_backbone", ".mim", "configs")
TORCH_VERSION = torch.__version__.split("+")[0]
MMCV_VERSION = "2.1.0"  # as tools/setup_env.sh
TORCHVISION_VERSION = {"2.14.1": "0.29.1"}.get(TORCH_VERSION)  # the one built for this torch
SCRIPTS = ("swin-extract-features", "swin-convert-checkpoint", "swin-benchmark", "swin-train", "swin-test",
           "swin-make-toy-data", "swin-buckets")
#: The old-stack venvs of `make test` (tools/setup_env.sh <stack>): environments users have.
OLD_STACKS = {"torch2.1": ".venv-torch2.1", "torch2.0": ".venv-torch2.0"}
#: What installing the package must never change in a user's environment.
NEVER_TOUCHED = ("torch", "torchvision", "triton", "numpy", "mmcv", "mmdet", "mmsegmentation", "mmengine")


@pytest.fixture(scope="module")
def sdist(wheel):
    """The sdist, built as pip and ``python -m build`` build it (setuptools' PEP 517 hook), from
    the copy of the source tree the wheel was built from (a second of work: nothing compiles)."""
    root = os.path.dirname(os.path.dirname(wheel))
    out = os.path.join(root, "sdist")
    run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])", out],
        os.path.join(root, "src"))
    (found,) = [n for n in os.listdir(out) if n.startswith("swin_backbone-") and n.endswith(".tar.gz")]
    return os.path.join(out, found)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with torch and the wheel (no extras)."""
    tmp = tmp_path_factory.mktemp("venv")
    work = tmp / "work"
    work.mkdir()
    run([sys.executable, "-m", "venv", str(tmp / "venv")], str(tmp))
    env = Venv(str(tmp / "venv"), str(work))
    env.pip("install", "-q", f"torch=={TORCH_VERSION}", wheel)
    yield env
    shutil.rmtree(env.path, ignore_errors=True)  # ~5 GB with torch's CUDA libraries


def test_wheel_ships_the_one_copy_of_the_configs(wheel):
    # ./configs in the checkout is a link to the package's configs, not a second copy.
    assert os.path.islink(os.path.join(ROOT, "configs"))
    assert os.path.realpath(os.path.join(ROOT, "configs")) == os.path.realpath(CONFIGS)
    shipped = {os.path.relpath(os.path.join(d, f), CONFIGS) for d, _, fs in os.walk(CONFIGS) for f in fs
               if f.endswith(".py")}
    assert "mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py" in shipped and "_base_/swin_backbone.py" in shipped
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    prefix = "swin_backbone/.mim/configs/"
    assert {n[len(prefix):] for n in names if n.startswith(prefix)} == shipped
    assert "swin_backbone/.mim/model-index.yml" in names  # mmengine reads it before .mim/configs
    assert not [n for n in names if n.split("/")[0] in ("tests", "tools", "configs")]
    # mmcv-lite's _ext finder, top-level, and the one line that installs it at interpreter start
    assert "_swin_backbone_mmcv_ext.py" in names
    with zipfile.ZipFile(wheel) as z:
        assert z.read("swin_backbone_mmcv_ext.pth").decode() == PTH_LINE
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    # torchvision pins one torch: only the test suite (which imports it) may ask for it.
    assert [r for r in requires if r.lower().startswith("torchvision")] == ['torchvision; extra == "test"']
    assert sorted(r.split("<")[0].split(">")[0].split("=")[0].lower() for r in base) == [
        "mmengine", "numpy", "pillow", "safetensors", "torch"]
    # Every torch >= 2.0 on Python >= 3.8: pip never replaces a user's torch to install this.
    assert "Requires-Python: >=3.8" in metadata
    assert [r for r in base if r.lower().startswith("torch")] == ["torch>=2.0"]
    assert [r for r in base if r.lower().startswith("numpy")] == ["numpy"]
    for extra in ("mmdet", "mmseg", "mmdet-lite", "mmseg-lite", "onnx", "test"):
        assert f"Provides-Extra: {extra}" in metadata
    assert "Provides-Extra: triton" not in metadata
    for script in SCRIPTS:
        assert f"{script} = swin_backbone.tools." in entry_points


def test_sdist_and_wheel_carry_the_license_docs_and_project_urls(wheel, sdist):
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        license_text = f.read()
    assert b"Apache License\n                           Version 2.0, January 2004" in license_text
    docs = {"docs/" + n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md")}
    assert "docs/checkpoints.md" in docs
    shipped = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(CONFIGS) for f in fs
               if f.endswith(".py")}
    # The sdist: the license, the README and the docs it links to, and what the wheel is built from.
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1]: m for m in t.getmembers() if m.isfile()}
        names = set(members)
        assert {"LICENSE", "README.md", "PKG-INFO", "setup.py", "setup.cfg", "pyproject.toml",
                "_swin_backbone_mmcv_ext.py", "swin_backbone/.mim/model-index.yml"} <= names, sorted(names)
        assert t.extractfile(members["LICENSE"]).read() == license_text
        pkg_info = t.extractfile(members["PKG-INFO"]).read().decode()
    assert {n for n in names if n.startswith("docs/")} == docs  # every docs/*.md; no measurement scripts or logs
    assert not [n for n in names if n.startswith("docs/measurements")]
    # The configs once, in the package (./configs in the checkout is a link to them).
    assert {n for n in names if n.startswith("swin_backbone/.mim/configs/")} == shipped
    assert not [n for n in names if n.startswith("configs/")]
    # The wheel: the license in its dist-info (licenses/ from setuptools 77, metadata 2.4), and both
    # metadata files name it and the project's URLs.
    with zipfile.ZipFile(wheel) as z:
        licenses = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/(licenses/)?LICENSE", n)]
        assert len(licenses) == 1, z.namelist()
        assert z.read(licenses[0]) == license_text
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for text in (metadata, pkg_info):
        lines = text.split("\n\n", 1)[0].splitlines()  # the headers (the README follows)
        assert "License-File: LICENSE" in lines
        assert "License: Apache-2.0" in lines
        urls = dict(line[len("Project-URL: "):].split(", ", 1) for line in lines if line.startswith("Project-URL: "))
        assert sorted(urls) == ["Documentation", "Issues", "Source"], urls
        assert all(url.startswith("https://") for url in urls.values()), urls
        assert urls["Documentation"].endswith("/docs") and urls["Issues"].endswith("/issues"), urls


def test_bare_install_imports_and_runs(venv):
    installed = venv.installed()
    assert installed["torch"] == TORCH_VERSION and "swin-backbone" in installed
    for absent in ("torchvision", "mmdet", "mmsegmentation", "mmcv"):
        assert absent not in installed, f"{absent} came with the bare install"
    venv.pip("check")
    out = venv.py("""
        import importlib.util, json, os, sys
        import torch, swin_backbone
        assert swin_backbone.__file__.startswith(sys.prefix), swin_backbone.__file__
        assert importlib.util.find_spec('torchvision') is None
        m = swin_backbone.SwinBackbone('tiny').eval()
        with torch.no_grad():
            outs = m(torch.randn(1, 3, 64, 64))
        torch.save(m.state_dict(), 'swin_t_ours.pth')
        root = os.path.join(os.path.dirname(swin_backbone.__file__), '.mim', 'configs')
        print('JSON ' + json.dumps(dict(registered=swin_backbone.REGISTERED_IN, shapes=[list(o.shape) for o in outs],
                              configs=sorted(os.listdir(root)))))
    """)
    result = json.loads(last(out, 'JSON '))
    assert result["registered"] == []
    assert result["shapes"] == [[1, 96, 16, 16], [1, 192, 8, 8], [1, 384, 4, 4], [1, 768, 2, 2]]
    assert {"mmdet", "mmseg", "_base_"} <= set(result["configs"])


def test_console_scripts_convert_a_checkpoint(venv):
    bindir = os.path.dirname(venv.python)
    for script in SCRIPTS:
        assert os.path.isfile(os.path.join(bindir, script)), script
    if not os.path.isfile(os.path.join(venv.work, "swin_t_ours.pth")):
        pytest.skip("needs test_bare_install_imports_and_runs's checkpoint")
    out = run([os.path.join(bindir, "swin-convert-checkpoint"), "swin_t_ours.pth", "swin_t_mmdet.pth", "--to", "mmdet"],
              venv.work)
    assert "wrote swin_t_mmdet.pth (mmdet layout, " in out
    out = venv.py("""
        import torch, swin_backbone
        sd = torch.load('swin_t_mmdet.pth', weights_only=True)['state_dict']
        print('FORMAT', swin_backbone.detect_format(list(sd)))
    """)
    assert last(out, "FORMAT ") == "mmdet"
    assert "usage:" in run([venv.python, "-m", "swin_backbone.tools.convert_checkpoint", "--help"], venv.work)


def test_extract_features_entry_point(venv):
    if not os.path.isfile(os.path.join(venv.work, "swin_t_ours.pth")):
        pytest.skip("needs test_bare_install_imports_and_runs's checkpoint")
    venv.py("""
        import numpy as np
        from PIL import Image
        rng = np.random.default_rng(0)
        Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save('photo.png')
    """)
    run([venv.python, "-m", "swin_backbone.tools.extract_features", "photo.png", "feats", "--arch", "tiny",
         "--checkpoint", "swin_t_ours.pth", "--no-progress"], venv.work)
    out = venv.py("""
        import numpy as np
        z = np.load('feats/photo.npz')
        print('STAGES', sorted((k, z[k].shape) for k in z.files))
    """)
    assert last(out, "STAGES ") == str([("stage0", (96, 16, 24)), ("stage1", (192, 8, 12)),
                                                ("stage2", (384, 4, 6)), ("stage3", (768, 2, 3))])


@pytest.mark.parametrize("stack", sorted(OLD_STACKS))
def test_installing_into_an_existing_environment_changes_nothing_of_it(stack, wheel, tmp_path):
    python = os.path.join(ROOT, OLD_STACKS[stack], "bin", "python")
    if not os.path.isfile(python):
        pytest.skip(f"no {OLD_STACKS[stack]} (`make test` sets it up: tools/setup_env.sh {stack})")
    before = Venv(os.path.dirname(os.path.dirname(python)), str(tmp_path)).installed()
    has_mmcv = "mmcv" in before
    extras = "[mmdet,mmseg]" if has_mmcv else ""  # PyPI's mmcv is a source build
    report = tmp_path / "report.json"
    run([python, "-m", "pip", "--disable-pip-version-check", "install", "--dry-run", "--quiet", "--report",
         str(report), f"{wheel}{extras}"], str(tmp_path))
    planned = {row["metadata"]["name"].lower(): row["metadata"]["version"]
               for row in json.loads(report.read_text())["install"]}
    assert "swin-backbone" in planned
    touched = {name: (before.get(name), planned[name]) for name in planned
               if name in NEVER_TOUCHED or name.startswith("nvidia-")}
    assert not touched, f"pip would change {touched} in the {stack} environment"
    assert before["torch"].split("+")[0] == {"torch2.1": "2.1.2", "torch2.0": "2.0.1"}[stack]
    if has_mmcv:
        assert before["mmcv"] == MMCV_VERSION
        # The full mmcv stays what runs: swin_backbone's stand-in for its ops stays off.
        out = run([python, "-c", "import swin_backbone, mmcv.ops; from swin_backbone import mmcv_lite; "
                   "import mmcv._ext as e; print('LITE', mmcv_lite.active(), hasattr(e, '__file__') and "
                   "e.__file__.endswith('.so'))"], str(tmp_path))
        assert last(out, "LITE ") == "False True"


@pytest.mark.parametrize("extras", ["[mmdet,mmseg]", "[mmdet-lite,mmseg-lite]"])
def test_no_extra_compiles_mmcv_in_a_fresh_environment(venv, wheel, extras, tmp_path):
    """A torch-only environment (no mmcv): pip's plan downloads wheels only, so nothing is built;
    the plain extras leave mmcv to the user, the lite ones bring the pure-Python mmcv-lite."""
    report = tmp_path / "report.json"
    venv.pip("install", "--dry-run", "--quiet", "--report", str(report), f"{wheel}{extras}")
    rows = json.loads(report.read_text())["install"]
    planned = {row["metadata"]["name"].lower(): row["metadata"]["version"] for row in rows}
    built = [row["metadata"]["name"] for row in rows
             if not row["download_info"]["url"].endswith(".whl") and row["metadata"]["name"] != "swin-backbone"]
    assert not built, f"pip would build {built} from source for {extras}"
    assert "mmcv" not in planned and "torch" not in planned and "torchvision" not in planned
    assert ("mmcv-lite" in planned) == extras.startswith("[mmdet-lite")


@pytest.fixture(scope="module")
def venv_mm(venv, wheel):
    """The same venv with the [mmdet-lite,mmseg-lite] extras and the torchvision built for torch."""
    if TORCHVISION_VERSION is None:
        pytest.skip(f"which torchvision goes with torch {TORCH_VERSION} is not written down here")
    venv.pip("install", "-q", f"{wheel}[mmdet-lite,mmseg-lite]", f"torch=={TORCH_VERSION}",
             f"torchvision=={TORCHVISION_VERSION}")
    return venv


def test_extras_install_what_they_promise(venv_mm):
    installed = venv_mm.installed()
    assert installed["torch"] == TORCH_VERSION  # the extras never replace the user's torch
    assert installed["mmcv-lite"] == MMCV_VERSION and "mmcv" not in installed
    for name in ("mmdet", "mmsegmentation", "mmengine", "ftfy", "regex"):
        assert name in installed, name
    assert int(installed["setuptools"].split(".")[0]) < 81  # mmengine's `pkg::` lookup uses pkg_resources
    venv_mm.pip("check")
    out = venv_mm.py("""
        import swin_backbone, mmdet.models, mmseg.models
        import mmcv.ops, torch
        from swin_backbone import mmcv_lite
        print('LITE', mmcv_lite.active())
        mmcv.ops.nms(torch.rand(3, 4).cumsum(1), torch.rand(3), 0.5)
    """)
    assert last(out, "LITE ") == "True"
    assert "has no compiled ops (mmcv-lite)" in out  # the one line that says so (with the first op)


def test_registries_and_config_scope(venv_mm):
    with open(os.path.join(venv_mm.work, "my_det.py"), "w") as f:
        f.write("_base_ = 'swin_backbone::mmdet/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'\n"
                "model = dict(backbone=dict(init_cfg=None), roi_head=dict(bbox_head=dict(num_classes=3)))\n")
    with open(os.path.join(venv_mm.work, "my_seg.py"), "w") as f:
        f.write("_base_ = 'swin_backbone::mmseg/upernet_swin-t_512x512_160k_ade20k.py'\n"
                "model = dict(backbone=dict(init_cfg=None))\n")
    out = venv_mm.py("""
        import json, sys
        import torch
        import swin_backbone
        from mmengine.config import Config
        from mmengine.registry import init_default_scope

        result = dict(registered=swin_backbone.REGISTERED_IN)
        for lib in ('mmdet', 'mmseg'):
            registry = __import__(f'{lib}.registry', fromlist=['MODELS']).MODELS
            m = registry.build(dict(type='SwinBackbone', arch=None, embed_dims=16, depths=(1, 1),
                                    num_heads=(1, 2), out_indices=(1,))).eval()
            result[lib] = [type(m).__name__, list(m(torch.randn(1, 3, 32, 32))[0].shape)]
        for name, lib in (('my_det.py', 'mmdet'), ('my_seg.py', 'mmseg')):
            cfg = Config.fromfile(name)
            init_default_scope(cfg.default_scope)
            registry = __import__(f'{lib}.registry', fromlist=['MODELS']).MODELS
            model = registry.build(cfg.model)
            base = [line for line in cfg.text.splitlines() if '.mim/configs/' in line]
            result[name] = dict(scope=cfg.default_scope, backbone=type(model.backbone).__name__,
                                head=cfg.model.get('roi_head', {}).get('bbox_head', {}).get('num_classes'),
                                base_in_site_packages=bool(base) and all(l.startswith(sys.prefix) for l in base))
        print('JSON ' + json.dumps(result))
    """)
    result = json.loads(last(out, 'JSON '))
    assert result["registered"] == ["mmdet", "mmseg"]
    assert result["mmdet"] == result["mmseg"] == ["SwinBackbone", [1, 32, 4, 4]]
    assert result["my_det.py"] == dict(scope="mmdet", backbone="SwinBackbone", head=3, base_in_site_packages=True)
    assert result["my_seg.py"] == dict(scope="mmseg", backbone="SwinBackbone", head=None, base_in_site_packages=True)


# ------------------------------------------------------- mmdet's and mmseg's own entry points
TOY_DET = "toy/mask-rcnn_swin-toy_fpn_toy-coco.py"
TOY_SEG = "toy/upernet_swin-toy_toy-ade.py"
#: Short runs: two iterations, a checkpoint at the end, no worker processes.
SHORT = ["--cfg-options", "train_cfg.max_iters=2", "train_cfg.val_interval=2", "default_hooks.checkpoint.interval=2",
         "train_dataloader.num_workers=0", "train_dataloader.persistent_workers=False",
         "val_dataloader.num_workers=0", "val_dataloader.persistent_workers=False",
         "test_dataloader.num_workers=0", "test_dataloader.persistent_workers=False"]


def package_path(venv, package: str) -> str:
    """Where ``package`` is installed in ``venv`` (found, not imported)."""
    out = venv.py(f"import importlib.util; print('PATH', importlib.util.find_spec({package!r}).submodule_search_locations[0])")
    return last(out, "PATH ")


@pytest.fixture(scope="module")
def toy(venv_mm, tmp_path_factory):
    """The README's demo as a pip user runs it, with nothing of the checkout: toy data from
    ``swin-make-toy-data``, two iterations of the shipped toy Mask R-CNN through ``swin-train``
    (by its ``swin_backbone::`` name) and of the toy UPerNet through mmseg's own tools/train.py
    (the shipped config file: its ``custom_imports`` name the package)."""
    tmp = tmp_path_factory.mktemp("toy")
    bindir = os.path.dirname(venv_mm.python)
    env = dict(TOY_DATA_ROOT=str(tmp / "data"))
    run([os.path.join(bindir, "swin-make-toy-data"), "--out", str(tmp / "data"), "--num-train", "4", "--num-val", "2",
         "--seed", "3"], str(tmp))
    run([os.path.join(bindir, "swin-train"), "swin_backbone::" + TOY_DET, "--work-dir", str(tmp / "det"), *SHORT],
        str(tmp), env=env)
    configs = os.path.join(package_path(venv_mm, "swin_backbone"), ".mim", "configs")
    mmseg_tools = os.path.join(package_path(venv_mm, "mmseg"), ".mim", "tools")
    run([venv_mm.python, os.path.join(mmseg_tools, "train.py"), os.path.join(configs, TOY_SEG), "--work-dir",
         str(tmp / "seg"), *SHORT], str(tmp), env=env)
    return dict(tmp=tmp, env=env, configs=configs, det=str(tmp / "det" / "iter_2.pth"),
                seg=str(tmp / "seg" / "iter_2.pth"))


def test_pip_users_demo_trains_and_tests(venv_mm, toy):
    """swin-train wrote its checkpoint; swin-test and python -m swin_backbone.tools.test
    evaluate it (COCO mAP, mIoU). Needs mmengine checkpoints to load on torch >= 2.6."""
    assert os.path.isfile(toy["det"]) and os.path.isfile(toy["seg"])
    out = run([os.path.join(os.path.dirname(venv_mm.python), "swin-test"), "swin_backbone::" + TOY_DET, toy["det"],
               "--work-dir", str(toy["tmp"] / "det-test")], str(toy["tmp"]), env=toy["env"])
    assert "coco/bbox_mAP" in out
    out = run([venv_mm.python, "-m", "swin_backbone.tools.test", "swin_backbone::" + TOY_SEG, toy["seg"],
               "--work-dir", str(toy["tmp"] / "seg-test")], str(toy["tmp"]), env=toy["env"])
    assert "mIoU" in out


def test_mmdets_own_train_resume_and_test(venv_mm, toy):
    """mmdet's tools/train.py, train.py --resume and tools/test.py, from the installed mmdet, on
    the shipped toy config (custom_imports). --resume and test.py need mmengine checkpoints to
    load on torch >= 2.6."""
    tools = os.path.join(package_path(venv_mm, "mmdet"), ".mim", "tools")
    config = os.path.join(toy["configs"], TOY_DET)
    work = str(toy["tmp"] / "mmdet-det")
    run([venv_mm.python, os.path.join(tools, "train.py"), config, "--work-dir", work, *SHORT], str(toy["tmp"]),
        env=toy["env"])
    resumed = [a.replace("max_iters=2", "max_iters=3").replace("interval=2", "interval=3") for a in SHORT]
    out = run([venv_mm.python, os.path.join(tools, "train.py"), config, "--work-dir", work, "--resume", *resumed],
              str(toy["tmp"]), env=toy["env"])
    assert "resumed epoch: 0, iter: 2" in out
    assert os.path.isfile(os.path.join(work, "iter_3.pth"))
    out = run([venv_mm.python, os.path.join(tools, "test.py"), config, os.path.join(work, "iter_3.pth"),
               "--work-dir", str(toy["tmp"] / "mmdet-det-test")], str(toy["tmp"]), env=toy["env"])
    assert "coco/bbox_mAP" in out


def test_mmdets_own_dist_train(venv_mm, request):
    """mmdet's tools/dist_train.sh (torch.distributed.launch + mmengine's pytorch launcher, which
    needs CUDA: mmengine calls torch.cuda.set_device) on one GPU, the shipped toy config."""
    has_cuda = last(venv_mm.py("import torch; print('CUDA', torch.cuda.is_available())"), "CUDA ") == "True"
    if not has_cuda:
        pytest.skip("mmdet's dist_train.sh launches mmengine's pytorch launcher, which needs CUDA")
    toy = request.getfixturevalue("toy")
    tools = os.path.join(package_path(venv_mm, "mmdet"), ".mim", "tools")
    work = str(toy["tmp"] / "mmdet-dist")
    env = dict(toy["env"], PATH=os.path.dirname(venv_mm.python) + os.pathsep + os.environ.get("PATH", ""),
               PORT="29533")
    run(["bash", os.path.join(tools, "dist_train.sh"), os.path.join(toy["configs"], TOY_DET), "1", "--work-dir", work,
         *SHORT], str(toy["tmp"]), env=env)
    assert os.path.isfile(os.path.join(work, "iter_2.pth"))


API_PROBE = """
import sys
import numpy as np
order, lib, config, weights = sys.argv[1:5]
if order == 'ours-first':
    import swin_backbone
if lib == 'mmdet':
    from mmdet.apis import DetInferencer as Inferencer, inference_detector as infer, init_detector as init
else:
    from mmseg.apis import MMSegInferencer as Inferencer, inference_model as infer, init_model as init
image = (np.random.RandomState(0).rand(90, 130, 3) * 255).astype(np.uint8)
for w in (None, weights):
    model = init(config, w, device='cpu')
    infer(model, image)
    Inferencer(model=config, weights=w, device='cpu')(image, return_vis=False)
print('OK', type(model.backbone).__name__, type(model.data_preprocessor).__name__)
"""


@pytest.mark.parametrize("order", ["apis-first", "ours-first"])
@pytest.mark.parametrize("lib", ["mmdet", "mmseg"])
def test_apis_and_inferencers_in_either_import_order(venv_mm, toy, lib, order):
    """init_detector + inference_detector and DetInferencer (mmseg: init_model + inference_model
    and MMSegInferencer), without and with weights, whether the script imports mmdet's apis or
    swin_backbone first (a fresh process each). With weights: mmengine checkpoints on torch >= 2.6."""
    config = os.path.join(toy["configs"], TOY_DET if lib == "mmdet" else TOY_SEG)
    out = venv_mm.py(API_PROBE, order, lib, config, toy["det" if lib == "mmdet" else "seg"])
    expected = "SwinDetDataPreprocessor" if lib == "mmdet" else "SwinSegDataPreProcessor"
    assert last(out, "OK ") == f"SwinBackbone {expected}"


def test_plain_mmdet_and_mmseg_models_need_nothing_of_ours(venv_mm):
    """RetinaNet R-18 and PSPNet R-18 from mmdet's and mmseg's own configs, in an environment with
    the package installed: mmcv's ops come from the stand-in and swin_backbone is never imported."""
    det = os.path.join(package_path(venv_mm, "mmdet"), ".mim", "configs", "retinanet", "retinanet_r18_fpn_1x_coco.py")
    seg = os.path.join(package_path(venv_mm, "mmseg"), ".mim", "configs", "pspnet",
                       "pspnet_r18-d8_4xb2-80k_cityscapes-512x1024.py")
    out = venv_mm.py("""
        import sys
        import numpy as np
        from mmdet.apis import inference_detector, init_detector
        from mmseg.apis import inference_model, init_model
        image = (np.random.RandomState(0).rand(96, 128, 3) * 255).astype(np.uint8)
        det = init_detector(sys.argv[1], None, device='cpu')
        inference_detector(det, image)
        seg = init_model(sys.argv[2], None, device='cpu')
        inference_model(seg, image)
        print('PLAIN', type(det.backbone).__name__, type(seg.backbone).__name__, 'swin_backbone' in sys.modules,
              sys.modules['mmcv._ext'].__name__)
    """, det, seg)
    assert last(out, "PLAIN ") == "ResNet ResNetV1c False mmcv._ext"


# ------------------------------------------------------------------- the .pth, installed and removed
PTH_PROBE = ("import sys; print('FINDERS', [getattr(f, '__name__', type(f).__name__) for f in sys.meta_path][-1], "
             "'swin_backbone' in sys.modules, 'torch' in sys.modules)")


def find_python(version: str):
    """A working ``python<version>``: on PATH, else one of pyenv's (whose shims refuse versions
    that are not selected)."""
    import glob

    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for candidate in [shutil.which(f"python{version}")] + sorted(
            glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", f"python{version}"))):
        if candidate and subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return None


@pytest.mark.parametrize("how,python", [("wheel", "3.8"), ("wheel", "3.12"), ("sdist", "3.8"), ("editable", "3.12")])
def test_pth_installs_the_finder_at_start_and_uninstall_removes_it(wheel, sdist, how, python, tmp_path):
    """A bare venv of the oldest and newest Python declared (no torch: the .pth needs nothing),
    the package from a wheel, an sdist or a checkout (editable): at start the finder is last on
    sys.meta_path and nothing heavy is imported; ``pip uninstall`` removes the .pth and the module."""
    interpreter = find_python(python)
    if interpreter is None:
        pytest.skip(f"no python{python} on this machine (PATH, pyenv)")
    src = os.path.join(os.path.dirname(os.path.dirname(wheel)), "src")
    target = {"wheel": [wheel], "sdist": [sdist], "editable": ["-e", src]}[how]
    run([interpreter, "-m", "venv", str(tmp_path / "venv")], str(tmp_path))
    env = Venv(str(tmp_path / "venv"), str(tmp_path))
    env.pip("install", "-q", "--no-deps", *target)
    assert last(env.py(PTH_PROBE), "FINDERS ") == "MmcvExtFinder False False"
    env.pip("uninstall", "-y", "-q", "swin-backbone")
    site = last(env.py("import sysconfig; print('SITE', sysconfig.get_paths()['purelib'])"), "SITE ")
    assert not [n for n in os.listdir(site) if "swin" in n.lower()], os.listdir(site)
    assert last(env.py(PTH_PROBE), "FINDERS ") != "MmcvExtFinder False False"
