"""The benchmark runs end to end (tiny sizes) and writes every measure it promises."""
import argparse
import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from swin_backbone.tools.benchmark import ABLATIONS, V2_ABLATIONS


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
    assert "v2_ablation" not in results and "Swin V2" not in stdout  # V2 only with --v2


def test_benchmark_ablation_only_some_variants(tmp_path):
    results, _ = _run(tmp_path, "--ablate", "--only", "share 0.5", "--skip-memory")
    assert set(results["ablation"]["rows"]) == {"defaults", "fixup share 0.5"}
    assert "v2_ablation" not in results


def _check_ablation(ablation, variants, memory):
    """Every variant has a row of finite, positive times (and peak memory), finite effects."""
    assert set(ablation) == {"eval_size", "train_size", "rows", "samples"}
    assert ablation["eval_size"] == [64, 96] and ablation["train_size"] == 64
    rows = ablation["rows"]
    assert set(rows) == {"defaults", *variants}
    for name, row in rows.items():
        assert 0 < row["eval_s"] < math.inf and 0 < row["train_s"] < math.inf, name
        assert -1 < row["eval_effect"] < math.inf and -1 < row["train_effect"] < math.inf, name
        if memory:
            assert 0 < row["peak_bytes"] < math.inf and -1 < row["memory_effect"] < math.inf, name
        else:
            assert "peak_bytes" not in row and "memory_effect" not in row, name
    for kind in ("eval", "train"):
        assert set(ablation["samples"][kind]) == set(rows)
    return rows


def test_benchmark_v2_ablation(tmp_path):
    """--ablate --v2 only: SwinV2Backbone's ablation alone, every variant with memory measured by
    the V2 memory child (``--memory-child v2:ours --ablate-variant V``)."""
    results, stdout = _run(tmp_path, "--ablate", "--v2", "only")
    assert "ablation" not in results  # 'only': no V1 ablation
    rows = _check_ablation(results["v2_ablation"], V2_ABLATIONS, memory=True)
    assert "Swin V2 ablation of SwinV2Backbone tiny, window 8" in stdout
    for name in rows:
        assert name in stdout
    # The switch reaches V2's children too: its norm -> qkv / cosine / MLP -> norm functions
    # off keep more activations for backward.
    assert rows["no memory-saving norm->linear/MLP"]["peak_bytes"] > rows["defaults"]["peak_bytes"]


def test_benchmark_ablation_v1_then_v2_only_some_variants(tmp_path):
    """--ablate --v2: V1's ablation, then V2's; --only picks the variants of both."""
    results, stdout = _run(tmp_path, "--ablate", "--v2", "--only", "share 0.5", "SDPA", "--skip-memory")
    chosen = {"fixup share 0.5", "no SDPA (matmul attention)"}
    _check_ablation(results["ablation"], chosen, memory=False)
    _check_ablation(results["v2_ablation"], chosen, memory=False)
    assert 0 <= stdout.index("\nablation (") < stdout.index("\nSwin V2 ablation of SwinV2Backbone")


def test_v2_ablation_runs_each_variant_on_the_v2_model(monkeypatch):
    """In process: every forward of the V2 ablation runs SwinV2Backbone (never V1's model) under
    its variant's planner switches, in eval and in training."""
    from swin_backbone import SwinV2Backbone, ops
    from swin_backbone.tools import benchmark

    seen = []

    def build_v2(*args, **kwargs):
        models = real_build_v2(*args, **kwargs)
        assert isinstance(models["ours"], SwinV2Backbone)

        def record(module, inputs):
            with ops.override() as current:  # (no changes: the switches in effect)
                seen.append((module.training, current))

        models["ours"].register_forward_pre_hook(record)
        return models

    def build_pair(*args, **kwargs):
        raise AssertionError("--v2 only built the V1 model")

    children = []

    def peak_memory(name, device, batch, size, variant=None, dtype=None):
        children.append((name, tuple(size), variant))
        return 2**20

    real_build_v2 = benchmark.build_v2
    monkeypatch.setattr(benchmark, "build_v2", build_v2)
    monkeypatch.setattr(benchmark, "build_pair", build_pair)
    monkeypatch.setattr(benchmark, "peak_memory", peak_memory)
    args = argparse.Namespace(device="cpu", iters=1, warmup=0, skip_memory=False, eval_size=(32, 48), train_size=32,
                              v2="only", only=None)
    results = {}
    benchmark.run_ablations(args, results)
    with ops.override() as defaults:
        pass
    variants = [None, *V2_ABLATIONS]
    expected = [dataclasses.replace(defaults, **benchmark.switches(v)) for v in variants]
    assert seen == [(False, s) for s in expected] + [(True, s) for s in expected]
    # Memory: V2's model in the child, under each variant.
    assert children == [("v2:ours", (32, 32), v) for v in variants]
    assert set(results) == {"v2_ablation"}
    assert set(results["v2_ablation"]["rows"]) == {"defaults", *V2_ABLATIONS}


def test_ablation_only_matching_nothing_fails_before_anything_runs(monkeypatch):
    from swin_backbone.tools import benchmark

    def build(*args, **kwargs):
        raise AssertionError("built a model for an --only that matches no variant")

    monkeypatch.setattr(benchmark, "build_pair", build)
    monkeypatch.setattr(benchmark, "build_v2", build)
    for v2 in (None, "also", "only"):
        args = argparse.Namespace(device="cpu", v2=v2, only=["no such variant"])
        with pytest.raises(ValueError, match="--only"):
            benchmark.run_ablations(args, {})


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
