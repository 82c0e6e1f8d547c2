"""tools/benchmark.py runs end to end (tiny sizes) and writes every measure it promises."""
import json
import subprocess
import sys


def test_benchmark_small_run(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "tools/benchmark.py", "--iters", "2", "--warmup", "1", "--eval-size", "64", "96",
           "--train-size", "64", "--json", str(out), "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for key in ("forward_eval", "forward_backward"):
        assert set(results[key]["samples"]) == {"ours", "mmdet"}
        assert len(results[key]["samples"]["ours"]) == 2 and results[key]["speedup"] > 0
    assert results["peak_memory"]["ours_bytes"] > 0 and results["peak_memory"]["mmdet_bytes"] > 0
    assert 0 < results["flops"]["fraction_of_ceiling"] and results["flops"]["gflop"] > 0
    for line in ("forward eval 1x3x64x96", "forward+backward train 2x3x64x64", "peak memory", "FLOPs"):
        assert line in proc.stdout
