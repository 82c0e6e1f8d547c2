"""The benchmark runs end to end (tiny sizes) and writes every measure it promises."""
import json
import subprocess
import sys

from swin_backbone.tools.benchmark import ABLATIONS


def _run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "tools/benchmark.py", "--iters", "2", "--warmup", "1", "--eval-size", "64", "96",
           "--train-size", "64", "--json", str(out), "--device", "cpu", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_benchmark_small_run(tmp_path):
    results, stdout = _run(tmp_path, "--upernet", "configs/toy/upernet_swin-toy_toy-ade.py", "--upernet-size", "64")
    assert set(results["forward_eval"]["samples"]) == {"ours", "mmdet", "timm", "torchvision"}
    assert set(results["forward_eval"]["speedup_over_mmdet"]) == {"ours", "timm", "torchvision"}
    assert set(results["forward_eval"]["ours_speedup_over"]) == {"timm", "torchvision"}
    assert set(results["forward_backward"]["samples"]) == {"ours", "mmdet"}
    for key in ("forward_eval", "forward_backward"):
        assert len(results[key]["samples"]["ours"]) == 2 and results[key]["speedup"] > 0
    assert results["peak_memory"]["ours_bytes"] > 0 and results["peak_memory"]["mmdet_bytes"] > 0
    assert 0 < results["flops"]["fraction_of_ceiling"] and results["flops"]["gflop"] > 0
    assert results["valid_sizes_overhead"]["overhead"] > -1
    assert len(results["valid_sizes_overhead"]["samples"]["valid_sizes"]) == 2
    for line in ("forward eval 1x3x64x96", "forward+backward train 2x3x64x64", "peak memory", "FLOPs",
                 "UPerNet training step bf16 2x3x64x64", "valid_sizes overhead"):
        assert line in stdout
    assert set(results["upernet_train_bf16"]["samples"]) == {"mmseg", "ours"}


def test_benchmark_ablation(tmp_path):
    results, stdout = _run(tmp_path, "--ablate")
    rows = results["ablation"]["rows"]
    assert set(rows) == {"defaults", *ABLATIONS}
    for name, row in rows.items():
        assert row["eval_s"] > 0 and row["train_s"] > 0 and row["peak_bytes"] > 0
        assert name in stdout
    # Turning the memory-saving functions off keeps more activations for backward.
    assert rows["no memory-saving norm->linear/MLP"]["peak_bytes"] > rows["defaults"]["peak_bytes"]


def test_benchmark_ablation_only_some_variants(tmp_path):
    results, _ = _run(tmp_path, "--ablate", "--only", "share 0.5", "--skip-memory")
    assert set(results["ablation"]["rows"]) == {"defaults", "fixup share 0.5"}
