"""What the package promises about the Python and torch it runs on (docs/compatibility.md).

* The code is Python 3.8 syntax and stdlib (vermin, a test dependency, reads the package).
* Below the torch floor, ``import swin_backbone`` raises one ``ImportError`` naming the
  installed torch and the supported range.
* The feature table of the compatibility suites (``tests/helpers.py``) answers what the installed
  torch really has; each fallback of ``swin_backbone.torch_compat`` (SDPA without ``scale=``,
  one checkpoint unpickler on every torch) does what its documentation says.

This file runs on every stack of ``make test`` (torch 2.14.1, 2.1.2 and 2.0.1).
"""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
from collections import OrderedDict

import numpy as np
import pytest
import torch

from swin_backbone import torch_compat

from .helpers import FEATURES, has_feature, missing_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "swin_backbone")
PYTHON_FLOOR = "3.8"


# ---------------------------------------------------------------------------- Python floor
def _vermin(*paths):
    import importlib.util

    # A test dependency (setup.cfg [test]): missing, the check fails rather than skips.
    assert importlib.util.find_spec("vermin") is not None, "vermin is not installed (pip install -e '.[test]')"
    # --violations: list only what needs a newer Python than the target; exit status 1 if any.
    cmd = [sys.executable, "-c", "import sys; from vermin.main import main; sys.exit(main())",
           f"-t={PYTHON_FLOOR}-", "--no-tips", "--violations", *paths]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # vermin in a subprocess
def test_package_needs_no_python_newer_than_the_floor():
    # The package, the interpreter-start module of mmcv-lite's finder and the build hooks.
    run = _vermin(PACKAGE, os.path.join(ROOT, "_swin_backbone_mmcv_ext.py"), os.path.join(ROOT, "setup.py"))
    assert run.returncode == 0 and "Target versions not met" not in run.stdout, run.stdout + run.stderr


@pytest.mark.slow  # vermin in a subprocess
def test_floor_check_catches_newer_syntax(tmp_path):
    # The check above can fail: a 3.9 stdlib name and 3.10 syntax are reported.
    (tmp_path / "new.py").write_text("import functools\n\n@functools.cache\ndef f(x):\n"
                                     "    match x:\n        case 1:\n            return 2\n")
    run = _vermin(str(tmp_path))
    assert run.returncode != 0 and "Target versions not met" in run.stdout, run.stdout + run.stderr
    assert "functools.cache" in run.stdout and "pattern matching" in run.stdout


def test_setup_cfg_declares_the_floors():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["options"]["python_requires"].strip() == f">={PYTHON_FLOOR}"
    requires = [r.strip() for r in cfg["options"]["install_requires"].strip().splitlines()]
    floor = ".".join(map(str, torch_compat.TORCH_FLOOR))
    assert f"torch>={floor}" in requires
    # Nothing pins torch's companions: pip must never have a reason to replace a user's torch.
    for line in requires:
        name = line.split(";")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip().lower()
        if name in ("torch", "torchvision", "numpy"):
            assert "<" not in line and "==" not in line, line
    for extra, body in cfg["options.extras_require"].items():
        for line in body.strip().splitlines():
            name = line.split(";")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
            if name in ("torch", "numpy"):
                assert not any(op in line.split(";")[0] for op in ("<", "==", ">")), (extra, line)


# ---------------------------------------------------------------------------- torch floor
@pytest.mark.slow  # a fresh interpreter (a subprocess)
def test_torch_below_the_floor_raises_one_import_error(tmp_path):
    # A stand-in `torch` package that reports version 1.13.1 and has no SDPA, like torch 1.13:
    # only for this test (a real torch 1.13 has no wheel for this Python).
    stub = tmp_path / "stub" / "torch"
    (stub / "nn").mkdir(parents=True)
    (stub / "__init__.py").write_text("__version__ = '1.13.1+cu117'\nfrom . import nn\n")
    (stub / "nn" / "__init__.py").write_text("from . import functional\n")
    (stub / "nn" / "functional.py").write_text("def relu(x):\n    return x\n")
    code = textwrap.dedent("""
        import sys
        try:
            import swin_backbone
        except BaseException as err:
            print('RAISED', type(err).__name__, '|', err)
        else:
            print('IMPORTED')
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "stub"), ROOT]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                         timeout=120)
    out = run.stdout.strip().splitlines()
    assert run.returncode == 0 and out, run.stdout + run.stderr
    assert out[-1].startswith("RAISED ImportError | "), out  # ImportError itself, not an AttributeError
    message = out[-1].split("| ", 1)[1]
    assert "1.13.1+cu117" in message and ">= 2.0" in message


# ---------------------------------------------------------------------------- feature table
def _expected_missing():
    """What each torch this project tests on lacks (None: a torch this table does not know)."""
    version = torch_compat.torch_version()
    py = sys.version_info[:2]
    if version == (2, 0):
        missing = {"sdpa_scale", "export", "onnx_dynamo", "load_mmap", "cpu_flash_sdpa",
                   "compile_one_graph"}
        return missing | ({"compile"} if py >= (3, 11) else set())
    if version == (2, 1):
        missing = {"export", "onnx_dynamo", "cpu_flash_sdpa", "compile_one_graph"}
        return missing | ({"compile"} if py >= (3, 12) else set())
    if version >= (2, 6):
        return set()
    return None


def test_feature_table_matches_the_installed_torch():
    expected = _expected_missing()
    missing = {name for name in FEATURES if not has_feature(name)}
    if expected is None:
        pytest.skip(f"no expectations written for torch {torch.__version__}")
    assert missing == expected, f"torch {torch.__version__}: missing {sorted(missing)}"
    for name in missing:
        reason = missing_reason(name)
        assert torch.__version__ in reason and "needs" in reason


def test_every_feature_documents_its_fallback():
    with open(os.path.join(ROOT, "docs", "compatibility.md")) as f:
        doc = f.read()
    for name, (test, needs, instead) in FEATURES.items():
        assert callable(test) and needs and instead, name
        assert f"`{name}`" in doc, f"docs/compatibility.md does not describe feature {name!r}"


# ---------------------------------------------------------------------------- SDPA
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("impl", ["public", "scaled_query"])
def test_sdpa_with_scale_on_every_torch(impl, scale):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 3, 7, 7, dtype=torch.float64)
    fn = torch_compat.scaled_dot_product_attention if impl == "public" else torch_compat._sdpa_scaled_query
    out = fn(q, k, v, attn_mask=bias, dropout_p=0.0, scale=scale)
    s = scale if scale is not None else 8 ** -0.5
    ref = torch.softmax(q @ k.transpose(-1, -2) * s + bias, dim=-1) @ v
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_sdpa_is_torchs_own_where_it_takes_scale():
    # No wrapper where torch takes scale= (no Python frame between the kernels and torch); the
    # scaled query only where it does not. Both take the keywords the package passes.
    if torch_compat.SDPA_HAS_SCALE:
        assert torch_compat.scaled_dot_product_attention is torch.nn.functional.scaled_dot_product_attention
    else:
        assert torch_compat.scaled_dot_product_attention is torch_compat._sdpa_scaled_query
    q = torch.randn(1, 2, 4, 8)
    out = torch_compat.scaled_dot_product_attention(q, q, q, attn_mask=None, dropout_p=0.0, scale=0.5)
    torch.testing.assert_close(out, torch.softmax(q @ q.transpose(-1, -2) * 0.5, -1) @ q)


# ---------------------------------------------------------------------------- loading
def _runner_like_checkpoint(path):
    """What an mmengine Runner saves: weights plus numpy values and a message hub in meta."""
    from mmengine.logging import MessageHub

    hub = MessageHub.get_instance("swin_backbone_compat_test")
    hub.update_scalar("train/loss", 0.5)
    hub.update_scalar("train/loss", 0.25)
    state = OrderedDict(weight=torch.arange(6.0).view(2, 3), bias=torch.zeros(2, dtype=torch.bfloat16))
    torch.save(dict(state_dict=state, meta=dict(seed=np.int64(3), lr=np.float64(0.1), hist=np.arange(4.0)),
                    message_hub=hub.state_dict()), path)
    return state


def test_the_inert_reader_reads_a_runner_checkpoint(tmp_path):
    """One unpickler on every torch (2.0 - today): a Runner-like checkpoint (numpy values, a
    message hub) reads whole, as data."""
    from swin_backbone.checkpoint import read_checkpoint

    state = _runner_like_checkpoint(tmp_path / "runner.pth")
    ckpt = read_checkpoint(str(tmp_path / "runner.pth"), map_location="cpu")
    for key, value in state.items():
        torch.testing.assert_close(ckpt["state_dict"][key], value)
    assert ckpt["meta"]["seed"] == 3 and type(ckpt["meta"]["seed"]) is np.int64
    assert ckpt["meta"]["lr"] == pytest.approx(0.1)
    np.testing.assert_array_equal(ckpt["meta"]["hist"], np.arange(4.0))
    assert ckpt["message_hub"]["log_scalars"]["train/loss"].statistics("mean") == pytest.approx(0.375)


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def _getattr_chain_payload(marker):
    # getattr(getattr(getattr, '__self__'), 'exec')('open(marker, "w")'): only getattr is a
    # global; what it returns is then called. Protocol 0 opcodes written by hand.
    code = f"open({str(marker)!r}, 'w').close()"
    return ("cbuiltins\ngetattr\n(cbuiltins\ngetattr\n(cbuiltins\ngetattr\nS'__self__'\ntRS'exec'\ntR"
            f"(S{code!r}\ntR.").encode()


def test_the_inert_unpickler_refuses_code(tmp_path):
    from swin_backbone.checkpoint.records import RefusedError
    from swin_backbone.checkpoint.unpickler import InertUnpickler

    marker = tmp_path / "ran"
    with pytest.raises(RefusedError, match=r"getattr\(the global builtins\.getattr, '__self__'\)"):
        InertUnpickler(io.BytesIO(_getattr_chain_payload(marker))).load()
    assert not marker.exists()
    with pytest.raises(RefusedError, match="posix.system|nt.system"):
        InertUnpickler(io.BytesIO(pickle.dumps(_Evil(), protocol=2))).load()
    # The plain unpickler would have run it: the payload is a real attack.
    pickle.loads(_getattr_chain_payload(marker))
    assert marker.exists()


