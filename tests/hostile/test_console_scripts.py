"""The console scripts as users run them: the installed entry points in subprocesses (with
PYTHONPATH at this checkout, so that the code under test is what runs). Exit status 0 on
success with the summary as readable lines on stdout (never a dict dump), 2 on usage errors,
1 on failures with one line saying why."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow  # console scripts as subprocesses: out of `make test-fast`
SMALL = ["--embed-dims", "16", "--depths", "1", "1", "1", "1", "--num-heads", "1", "2", "4", "8",
         "--random-weights", "--no-progress", "--workers", "0"]


def script(name):
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.isfile(path):
        pytest.skip(f"{name} is not installed beside {sys.executable} (pip install -e .)")
    return path


def run(name, *args, cwd=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([script(name), *map(str, args)], capture_output=True, text=True, env=env, timeout=300,
                          cwd=cwd or ROOT)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.RandomState(0)
    for name in ("a.png", "b.jpg"):
        Image.fromarray(rng.randint(0, 256, (24, 32, 3), dtype=np.uint8)).save(root / name)
    return root


def test_extract_features_success_exits_0_with_readable_lines(images, tmp_path):
    proc = run("swin-extract-features", images, tmp_path / "out", *SMALL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: 2 images" in proc.stdout and "index:" in proc.stdout
    assert "{" not in proc.stdout + proc.stderr  # no dict dump anywhere
    assert json.load(open(tmp_path / "out" / "index.json"))["images"] == 2


def test_extract_features_usage_error_exits_2(images, tmp_path):
    proc = run("swin-extract-features", images, tmp_path / "out", *SMALL, "--stages", "7")
    assert proc.returncode == 2
    assert "--stages" in proc.stderr and "usage:" in proc.stderr and "Traceback" not in proc.stderr


def test_extract_features_failure_exits_1_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run("swin-extract-features", tmp_path / "empty", tmp_path / "out", *SMALL)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "no images found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_python_m_and_the_repository_wrapper_give_the_same_statuses(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    (tmp_path / "empty").mkdir()
    wrapper = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "extract_features.py"),
                              str(tmp_path / "none"), str(tmp_path / "o")] + SMALL,
                             capture_output=True, text=True, env=env, timeout=300)
    assert wrapper.returncode == 2 and "input" in wrapper.stderr, wrapper.stderr
    module = subprocess.run([sys.executable, "-m", "swin_backbone.tools.extract_features",
                             str(tmp_path / "empty"), str(tmp_path / "o")] + SMALL,
                            capture_output=True, text=True, env=env, timeout=300)
    assert module.returncode == 1 and "no images found" in module.stderr, module.stderr


@pytest.mark.parametrize("name,args", [("train", []), ("test", ["none.pth"]), ("make_toy_data", ["--max-size", "8"])])
def test_train_test_and_toy_data_run_as_modules_and_as_wrappers(name, args, tmp_path):
    """``python -m swin_backbone.tools.<name>`` (what a pip install has) and the checkout's
    ``tools/<name>.py`` are one command: the same status and the same one-line error."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    argv = ([] if name == "make_toy_data" else [str(tmp_path / "none.py")]) + args
    runs = [subprocess.run([sys.executable, *how, *argv], capture_output=True, text=True, env=env, timeout=300,
                           cwd=str(tmp_path))
            for how in (["-m", f"swin_backbone.tools.{name}"], [os.path.join(ROOT, "tools", f"{name}.py")])]
    for proc in runs:
        last_line = proc.stderr.strip().splitlines()[-1]
        if name == "make_toy_data":  # argparse's usage error
            assert proc.returncode == 2 and "--min-size/--max-size" in last_line, proc.stderr
        else:
            assert proc.returncode == 1 and last_line.startswith(f"tools/{name}.py: error: config"), proc.stderr
            assert "no such file" in last_line and "Traceback" not in proc.stderr
    assert runs[0].stderr.strip().splitlines()[-1].split(": error: ")[-1] == \
        runs[1].stderr.strip().splitlines()[-1].split(": error: ")[-1]


@pytest.mark.parametrize("name", ["swin-train", "swin-test"])
def test_train_and_test_commands_name_themselves_in_their_errors(name, tmp_path):
    # (the checkout's tools/train.py says "tools/train.py: error: ...": the test above)
    proc = run(name, tmp_path / "none.py", *(["none.pth"] if name == "swin-test" else []), cwd=tmp_path)
    last_line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last_line.startswith(f"{name}: error: config"), proc.stderr
    assert "no such file" in last_line and "Traceback" not in proc.stderr


def test_benchmark_success_exits_0_without_a_dict_dump(tmp_path):
    # the benchmark's smallest real run: one round of each step at 32 x 32, no timm / torchvision;
    # the results as a table of readable lines (and in --json), never a dict dump
    proc = run("swin-benchmark", "--device", "cpu", "--size", "32", "32", "--iters", "1", "--warmup", "0",
               "--no-peers", "--json", tmp_path / "bench.json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("eval fp32 1x3x32x32: ") and "ours " in line for line in lines), proc.stdout
    assert any(line.startswith("train fwd+bwd fp32 2x3x32x32: ") for line in lines), proc.stdout
    assert any(line.startswith("ours ") and line.count("x") >= 2 for line in lines), proc.stdout  # its table row
    assert any(line.startswith("speedup: ") for line in lines), proc.stdout
    assert "{" not in proc.stdout + proc.stderr  # no dict dump anywhere
    assert "Traceback" not in proc.stderr
    result = json.load(open(tmp_path / "bench.json"))
    assert result["size"] == [32, 32] and result["eval"]["median_s"]["ours"] > 0
