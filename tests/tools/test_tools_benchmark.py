"""The benchmark runs end to end (tiny sizes) and writes every measure it promises."""
import argparse
import json
import subprocess
import sys

import pytest
import torch

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


def _check_rows(results, keys, models):
    for key in keys:
        row = results[key]
        assert set(row["samples"]) == set(models), key
        assert all(len(v) >= 1 and all(t > 0 for t in v) for v in row["samples"].values())
        if "timm" in models:
            assert set(row["speedup_over_timm"]) == set(models) - {"timm"}
            assert all(r > 0 for r in row["speedup_over_timm"].values())
            assert row["speedup"] > 0 and row["ours_s"] > 0
        if "torchvision" in models:
            assert set(row["ours_speedup_over"]) == {"torchvision"} and row["ours_speedup_over"]["torchvision"] > 0


def test_benchmark_v2_rows(tmp_path):
    pytest.importorskip("timm")
    results, stdout = _run(tmp_path, "--v2", "only")
    models = {"ours", "timm", "torchvision"}
    _check_rows(results, ["v2_eval_fp32_1x3x64x96", "v2_train_fp32_2x3x64x64"], models)
    assert "forward_eval" not in results  # 'only': no V1 rows
    memory = results["v2_peak_memory"]
    assert all(memory[f"{k}_bytes"] > 0 for k in models)
    assert memory["ratio_over_timm"] > 0 and memory["ratio_over_torchvision"] > 0
    for line in ("Swin V2 eval fp32 1x3x64x96", "Swin V2 train fwd+bwd fp32 2x3x64x64", "Swin V2 peak training memory"):
        assert line in stdout


def test_benchmark_v2_cuda_rows_run_on_the_cpu():
    """The CUDA run's V2 rows (bf16 autocast and fp32, batches 1 and 8) through the same code on
    the CPU, tiny: every row exists with positive ratios."""
    pytest.importorskip("timm")
    from swin_backbone.tools.benchmark import run_cuda_v2

    args = argparse.Namespace(device="cpu", iters=1, warmup=0, no_peers=False, skip_memory=True)
    results = {}
    run_cuda_v2(args, results, size=(32, 32))
    keys = [f"v2_eval_{t}_{b}x3x32x32" for t, b in (("bf16", 1), ("bf16", 8), ("fp32", 1))]
    keys += ["v2_train_bf16_2x3x32x32", "v2_train_fp32_2x3x32x32"]
    _check_rows(results, keys, {"ours", "timm", "torchvision"})


def test_v2_rows_share_their_weights():
    """ours, timm's and torchvision's V2-T of the V2 rows compute the same features from the same
    weights (at 256x256, where all three place the same windows in stages 1-3)."""
    pytest.importorskip("timm")
    from swin_backbone.tools.benchmark import build_v2

    models = build_v2("cpu", (256, 256))
    assert set(models) == {"ours", "timm", "torchvision"}
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        ours = models["ours"].eval()(x)
        theirs = models["timm"].eval()(x)
        tv = models["torchvision"].eval()(x)
    for i in range(3):  # our stage 1-3 output norms are unit LayerNorms (not in timm's classifier)
        ref = torch.nn.functional.layer_norm(theirs[i], theirs[i].shape[-1:]).permute(0, 3, 1, 2)
        torch.testing.assert_close(ours[i], ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tv, theirs[3], rtol=1e-4, atol=1e-4)
