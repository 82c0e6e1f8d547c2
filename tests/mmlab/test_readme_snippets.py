"""The README's snippets, extracted from README.md and run verbatim in a fresh process that
imports nothing of ours first.

The config snippets are used as mmdet's and mmseg's own tools/train.py use a config:
``Config.fromfile`` (which runs ``custom_imports``), then ``Runner.from_cfg`` (which builds the
model), then the optimizer the runner would train with. The process starts with the line of the
``.pth`` file the wheel installs (setup.py), as an installed package's interpreter does. The
``load_checkpoint`` snippet runs as a user's script, on a checkpoint of the name it loads."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pth_line() -> str:
    with open(os.path.join(ROOT, "setup.py")) as f:
        return re.search(r'^PTH_LINE = "(import [^"]*)\\n"$', f.read(), re.M).group(1)


def config_snippets():
    """Every ```python block of README.md that is a whole config (it names an mmdet:: / mmseg:: base)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    return [b for b in blocks if re.search(r"^_base_ = '(mmdet|mmseg)::", b, re.M)]


def python_snippets(containing: str):
    """The ```python blocks of README.md that contain ``containing``."""
    with open(os.path.join(ROOT, "README.md")) as f:
        return [b for b in re.findall(r"```python\n(.*?)```", f.read(), re.S) if containing in b]


PROBE = """
import json, sys
from mmengine.config import Config
from mmengine.runner import Runner
cfg = Config.fromfile(sys.argv[1])
cfg.work_dir = sys.argv[2]
runner = Runner.from_cfg(cfg)
print('BUILT', cfg.default_scope, type(runner.model.backbone).__name__)
# The optimizer a training run of this config gets (Runner.train builds it the same way).
optimizer = runner.build_optim_wrapper(runner.optim_wrapper).optimizer
decay = {id(p): g.get('weight_decay', optimizer.defaults['weight_decay'])
         for g in optimizer.param_groups for p in g['params']}
params = dict(runner.model.backbone.named_parameters())
print('OPTIM ' + json.dumps(dict(
    type=type(optimizer).__name__, lr=optimizer.defaults['lr'], weight_decay=optimizer.defaults['weight_decay'],
    decay={name: decay[id(params[name])] for name in (
        'stages.0.blocks.0.attn.qkv.weight', 'stages.0.blocks.0.norm1.weight',
        'stages.0.blocks.0.attn.relative_position_bias_table')},
    pretrained=cfg.model.backbone.init_cfg.checkpoint)))
"""
#: The Swin recipes of mmdet's and mmseg's own Swin configs (AdamW; no decay on norms and tables).
RECIPE = {"mmdet": dict(lr=1e-4, weight_decay=0.05), "mmseg": dict(lr=6e-5, weight_decay=0.01)}


def test_the_readme_has_a_detection_and_a_segmentation_snippet():
    scopes = sorted(re.search(r"^_base_ = '(\w+)::", b, re.M).group(1) for b in config_snippets())
    assert scopes == ["mmdet", "mmseg"], scopes


@pytest.mark.parametrize("index", range(2))
def test_readme_snippet_builds_as_in_the_libraries_train_py(index, tmp_path):
    snippet = config_snippets()[index]
    lib = re.search(r"^_base_ = '(\w+)::", snippet, re.M).group(1)
    pytest.importorskip(lib)
    path = tmp_path / "my_config.py"
    path.write_text(snippet)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", pth_line() + "\n" + PROBE, str(path), str(tmp_path / "work")],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("BUILT")][-1]
    assert line == f"BUILT {lib} SwinBackbone"
    # The library's own Swin recipe, not an R-50 config's SGD (which a Swin backbone trained from
    # scratch diverged with): AdamW at its lr and weight decay, none on norms and position tables.
    optim = json.loads([x for x in proc.stdout.splitlines() if x.startswith("OPTIM ")][-1][len("OPTIM "):])
    recipe = RECIPE[lib]
    assert (optim["type"], optim["lr"], optim["weight_decay"]) == ("AdamW", recipe["lr"],
                                                                   recipe["weight_decay"]), optim
    assert optim["decay"] == {"stages.0.blocks.0.attn.qkv.weight": recipe["weight_decay"],
                              "stages.0.blocks.0.norm1.weight": 0.0,
                              "stages.0.blocks.0.attn.relative_position_bias_table": 0.0}, optim
    # The base's ImageNet weights, by URL (README: downloaded when training starts).
    assert optim["pretrained"].startswith("https://"), optim["pretrained"]


def test_readme_load_checkpoint_snippet_reports_once(tmp_path):
    """The README's ``load_checkpoint`` snippet as a script: the per-key report comes out once
    (load_checkpoint logs it through mmengine's logger; the snippet must not print it again)."""
    import torch
    from swin_backbone import SwinBackbone

    (snippet,) = python_snippets("load_checkpoint(model, ")
    name = re.search(r"load_checkpoint\(model, '([^']+)'", snippet).group(1)
    torch.save(SwinBackbone(arch="tiny").state_dict(), str(tmp_path / name))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", pth_line() + "\n" + snippet], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count(f"checkpoint {name}: format 'ours'") == 1, out[-3000:]
    assert out.count("loaded     177/177 model tensors") == 1, out[-3000:]
