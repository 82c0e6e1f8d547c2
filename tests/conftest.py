import contextlib
import os
import sys

import pytest
import torch

# `make test` runs the suite in 2 pytest-xdist workers (a file per worker at a time, so a module's
# fixtures are built once): one intra-op thread each, and in the processes the tests start, so that
# the 2 cores are not oversubscribed (threads spinning against each other make small forwards 2-5x
# slower). Alone, 2 threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@contextlib.contextmanager
def _scope_restored():
    """mmengine's default scope afterwards as it was before. The latest ``DefaultScope`` is the
    one every registry builds from; a Runner or ``init_default_scope`` of a test or module run
    earlier in the same process (which ones depends on how the xdist workers share the files out)
    would otherwise decide what a later test's ``MODELS.build`` finds."""
    before = _scopes()
    saved = None if before is None else dict(before)
    yield
    after = _scopes()
    if after is not None:
        after.clear()
        after.update(saved or {})


@pytest.fixture(autouse=True, scope="module")
def _module_default_scope():
    """A module (its fixtures included) leaves the default scope as it found it."""
    with _scope_restored():
        yield


@pytest.fixture(autouse=True)
def _default_scope():
    """A test leaves the default scope as it found it (its module's fixtures' scope included)."""
    with _scope_restored():
        yield


def _scopes():
    """mmengine's ordered dict of ``DefaultScope`` instances (the last is current), where imported."""
    module = sys.modules.get("mmengine.registry.default_scope")
    return None if module is None else module.DefaultScope._instance_dict


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device this machine has (CPU always; CUDA where available, with TF32 off so that
    fp32 parity holds to 1e-4: cuDNN convolutions default to TF32)."""
    if request.param == "cuda":
        old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    else:
        yield torch.device("cpu")


@pytest.fixture
def one_thread():
    """One intra-op thread: on the shared 2-core test machine two threads spin against each
    other (and other jobs) and make small-input forwards of large models 2-5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["whole", "default", "tiny"])
def chunk_budget(request):
    """Chunk bytes: whole tensors, the planner's CPU size, and 3 rows of 32 float64 per chunk
    (ragged end)."""
    from swin_backbone.ops.planner import cpu_chunk_bytes

    return {"whole": 0, "default": cpu_chunk_bytes(), "tiny": 3 * 32 * 8}[request.param]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    """The toy COCO / ADE data set of tools/make_toy_data.py (8 training, 4 validation images):
    its folder, for the configs under configs/toy (``TOY_DATA_ROOT``)."""
    import subprocess
    import sys

    from .helpers import ROOT

    root = tmp_path_factory.mktemp("toy")
    subprocess.run([sys.executable, "tools/make_toy_data.py", "--out", str(root), "--num-train", "8",
                    "--num-val", "4", "--seed", "3"], check=True, cwd=ROOT)
    return str(root)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The package's wheel, built from a copy of the source tree (tests/packaging.py), for the
    install tests of the module that asks for it."""
    from .packaging import build_wheel

    return build_wheel(tmp_path_factory.mktemp("wheel"))


# ---------------------------------------------------------------------------- old stacks
# The compatibility suites (`make test`: docs/compatibility.md) run these files on torch 2.1 and
# the floor torch 2.0. Two rules keep them honest without hand-kept lists of tests:
#
# * ``@pytest.mark.torch_feature("name")``: the test needs a newer-torch feature of
#   ``tests/helpers.py``'s ``FEATURES``; it skips, naming the feature and the installed torch,
#   where torch lacks it. Only for what torch itself cannot do, never for a bug of ours.
# * A test whose own code imports mmcv / mmdet / mmseg skips where that library is not installed
#   (the floor stack has no mmcv build). Only an import written in a tests/ file, of a library
#   that is really absent, becomes a skip: the package importing one of them where it must not
#   still fails.
OPENMMLAB_LIBS = ("mmcv", "mmdet", "mmseg", "mmpretrain")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def pytest_runtest_setup(item):
    for marker in item.iter_markers("torch_feature"):
        from .helpers import has_feature, missing_reason

        for name in marker.args:
            if not has_feature(name):
                pytest.skip(f"torch feature {name!r} {missing_reason(name)}")


def _absent_library_import(excinfo):
    """The OpenMMLab library whose import, written in a tests/ file, failed because it is not
    installed; ``None`` for any other error."""
    import importlib.util

    err = excinfo.value
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return None
    root = err.name.split(".")[0]
    if root not in OPENMMLAB_LIBS or importlib.util.find_spec(root) is not None:
        return None
    frames = [e for e in excinfo.traceback if "importlib" not in str(e.path) and "<frozen" not in str(e.path)]
    if not frames or not os.path.abspath(str(frames[-1].path)).startswith(TESTS_DIR + os.sep):
        return None
    return root


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed and call.when in ("setup", "call"):
        lib = _absent_library_import(call.excinfo)
        if lib is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0,
                               f"Skipped: needs {lib}, which this environment does not install")
