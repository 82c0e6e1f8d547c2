"""When the stand-in switches on: with mmcv-lite (or compiled ops hidden), never with compiled ops,
one log line when mmcv first calls an op (not at import), whoever imports ``mmcv.ops`` first; one warning where both the ``mmcv`` and
``mmcv-lite`` distributions are installed; an ImportError naming the remedy without torchvision."""
import os
import re
import subprocess
import sys

import pytest

from swin_backbone import mmcv_lite
from swin_backbone.mmcv_lite import compiled_ext, ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LITE_MODE = os.path.join(ROOT, "tests", "mmcv_lite", "lite_mode.py")
LOG_LINE = "has no compiled ops (mmcv-lite)"
#: mmcv's NMS twice, after a marker: the log line comes with the first op mmcv calls, once.
FIRST_OPS = ("print('BEFORE THE FIRST OP', flush=True)\n"
             "import torch\n"
             "for _ in range(2):\n"
             "    mmcv.ops.nms(torch.rand(3, 4).cumsum(1), torch.rand(3), 0.5)\n")
PROBE = ("import sys, warnings; warnings.simplefilter('always')\n"
         "import swin_backbone, mmcv.ops\n"
         "from swin_backbone import mmcv_lite\n"
         "mmcv_lite.activate()  # a second call changes nothing\n"
         "print('ACTIVE', mmcv_lite.active(), type(sys.modules['mmcv._ext']).__name__,"
         " getattr(sys.modules['mmcv._ext'], '__file__', ''))\n") + FIRST_OPS


def run(args, pythonpath_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [pythonpath_extra, ROOT, env.get("PYTHONPATH")] if p)
    proc = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def active_line(out):
    return next(line for line in out.splitlines() if line.startswith("ACTIVE"))


def test_stand_in_is_mmcvs_ext_on_mmcv_lite():
    if compiled_ext() is not None:
        pytest.skip("this environment has compiled mmcv (test_compiled_ops_are_never_replaced covers it)")
    import mmcv

    assert mmcv_lite.active()
    assert sys.modules["mmcv._ext"] is ext and mmcv._ext is ext


def test_compiled_ops_are_never_replaced():
    if compiled_ext() is None:
        pytest.skip("compiled mmcv is not installed here (mmcv-lite): runs on the torch 2.1 stack")
    out = run(["-c", PROBE])
    assert active_line(out).startswith("ACTIVE False module") and active_line(out).endswith(".so")
    assert LOG_LINE not in out and not mmcv_lite.active()


def test_hidden_compiled_ops_switch_it_on_with_one_log_line():
    """What users of mmcv-lite get (on the torch 2.1 stack: its compiled ops hidden in a subprocess)."""
    out = run([LITE_MODE, "-c", PROBE])
    assert active_line(out) == "ACTIVE True module " + ext.__file__
    assert out.count(LOG_LINE) == 1
    assert out.index(LOG_LINE) > out.index("BEFORE THE FIRST OP")  # not when mmcv.ops was imported
    assert "both 'mmcv' and 'mmcv-lite' are installed" not in out


def _fake_distribution(tmp_path, name):
    """A distribution's metadata directory, as pip writes it, on a directory for PYTHONPATH."""
    info = tmp_path / f"{name.replace('-', '_')}-2.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 2.1.0\n")
    return str(tmp_path)


def test_both_distributions_installed_warn_once(tmp_path):
    installed = mmcv_lite.installed_mmcv_distributions()
    if not installed:
        pytest.skip("neither mmcv nor mmcv-lite is installed here")
    assert len(installed) == 1, installed
    other = "mmcv" if installed == ["mmcv-lite"] else "mmcv-lite"
    out = run([LITE_MODE, "-c", PROBE], pythonpath_extra=_fake_distribution(tmp_path, other))
    assert out.count("both 'mmcv' and 'mmcv-lite' are installed") == 1
    assert "pip uninstall" in out and active_line(out).startswith("ACTIVE True")


def test_without_torchvision_mmcv_ops_say_what_to_install():
    """The -lite extras cannot name torchvision (an unpinned torchvision makes pip replace torch):
    on mmcv-lite without it, ``import swin_backbone`` works and mmcv's ops fail with an
    ImportError that names the remedy."""
    probe = ("import sys, warnings; warnings.simplefilter('always')\n"
             "sys.modules['torchvision'] = None  # not installed\n"
             "import swin_backbone\n"
             "from swin_backbone import mmcv_lite\n"
             "try:\n"
             "    import mmcv.ops\n"
             "except ImportError as e:\n"
             "    print('ERROR', e)\n"
             "print('ACTIVE', mmcv_lite.active())\n")
    out = run([LITE_MODE, "-c", probe])
    assert active_line(out) == "ACTIVE False"
    error = next(line for line in out.splitlines() if line.startswith("ERROR"))
    assert "torchvision is not installed" in error and "install the torchvision built for your torch" in error
    assert "its ops run on torchvision / torch" not in out  # not the line that says it is on


def pth_line() -> str:
    """The line of the .pth file the wheel installs (setup.py), which a checkout does not have."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        return re.search(r'^PTH_LINE = "(import [^"]*)\\n"$', f.read(), re.M).group(1)


@pytest.mark.parametrize("first", ["mmcv.ops", "swin_backbone"])
def test_one_module_under_both_names_whoever_comes_first(first):
    probe = (pth_line() + f"\nimport {first}\n"
             "import sys, mmcv.ops, swin_backbone\n"
             "from swin_backbone.mmcv_lite import ext\n"
             "print('ACTIVE', sys.modules['mmcv._ext'] is ext, ext.__name__)\n") + FIRST_OPS
    out = run([LITE_MODE, "-c", probe])
    assert active_line(out).startswith("ACTIVE True"), out[-2000:]
    assert out.count(LOG_LINE) == 1 and out.index(LOG_LINE) > out.index("BEFORE THE FIRST OP")
