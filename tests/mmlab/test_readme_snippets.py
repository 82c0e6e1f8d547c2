"""The README's config snippets, extracted from README.md and used verbatim as mmdet's and
mmseg's own tools/train.py use a config: ``Config.fromfile`` (which runs ``custom_imports``),
then ``Runner.from_cfg`` (which builds the model), in a fresh process that imports nothing of
ours first. The process starts with the line of the ``.pth`` file the wheel installs (setup.py),
as an installed package's interpreter does."""
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


PROBE = """
import sys
from mmengine.config import Config
from mmengine.runner import Runner
cfg = Config.fromfile(sys.argv[1])
cfg.work_dir = sys.argv[2]
runner = Runner.from_cfg(cfg)
print('BUILT', cfg.default_scope, type(runner.model.backbone).__name__)
"""


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
