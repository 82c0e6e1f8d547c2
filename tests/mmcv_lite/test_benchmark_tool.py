"""tools/analysis_tools/benchmark_mmcv_lite.py runs (a smoke run: small sizes, one round; the figures in
docs/mmcv-lite.md come from full runs on a quiet machine) and refuses bad arguments."""
import importlib.util
import json
import os

import pytest

from swin_backbone.mmcv_lite import compiled_ext
from swin_backbone.mmcv_lite.ext import OPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("benchmark_mmcv_lite", os.path.join(
        ROOT, "tools", "analysis_tools", "benchmark_mmcv_lite.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_covered_op_and_the_train_step_are_timed(tool, tmp_path, one_thread, capsys):
    out = tmp_path / "bench.json"
    assert tool.main(["--quick", "--rounds", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    timed = {(r["op"], r["phase"]) for r in result["rows"]}
    ops = {name.rsplit("_forward", 1)[0].rsplit("_backward", 1)[0] for name in OPS}
    for op in ops:
        assert (op, "forward") in timed
        assert op == "nms" or (op, "backward") in timed
    assert any(r["op"].startswith("toy Mask R-CNN") for r in result["rows"])
    assert all(r["mmcv-lite_ms"] > 0 for r in result["rows"])
    assert result["compiled"] == (compiled_ext() is not None)
    if result["compiled"]:  # compiled mmcv 2.1.0 has CPU kernels for these
        with_kernel = {r["op"] for r in result["rows"] if r["baseline"] == "compiled mmcv"}
        assert {"nms", "roi_align", "modulated_deform_conv"} <= with_kernel
        assert all("compiled_ms" in r for r in result["rows"])
    assert "| roi_align | backward |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,says", [(["--rounds", "0"], "--rounds"), (["--device", "tpu"], "--device")])
def test_bad_arguments_are_refused(tool, argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        tool.main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err
