"""The benchmark runs end to end (tiny sizes) and writes every measure it promises."""
import argparse
import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from swin_backbone.tools import benchmark, benchmarking, gpu_report
from swin_backbone.tools.benchmark import ABLATIONS, V2_ABLATIONS


def _run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "tools/analysis_tools/benchmark.py", "--iters", "2", "--warmup", "1", "--eval-size", "64", "96",
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
    """--ablate --v2: every variant of V1's ablation, then of V2's, runs and reports (times only:
    the memory children are the next tests')."""
    results, stdout = _run(tmp_path, "--ablate", "--v2", "--skip-memory")
    _check_ablation(results["ablation"], ABLATIONS, memory=False)
    _check_ablation(results["v2_ablation"], V2_ABLATIONS, memory=False)
    for name in ABLATIONS:
        assert name in stdout
    assert 0 <= stdout.index("\nablation (") < stdout.index("\nSwin V2 ablation of SwinV2Backbone")


def test_benchmark_ablation_memory(tmp_path):
    # Turning lean saves off keeps more activations for backward (the norms' and GELU's outputs).
    results, stdout = _run(tmp_path, "--ablate", "--only", "lean saves", "--train-size", "256")
    rows = _check_ablation(results["ablation"], {"no lean saves (norm / GELU outputs kept)"}, memory=True,
                           train_size=256)
    assert rows["no lean saves (norm / GELU outputs kept)"]["peak_bytes"] > rows["defaults"]["peak_bytes"]
    assert "v2_ablation" not in results and "Swin V2" not in stdout  # V2 only with --v2


def _check_ablation(ablation, variants, memory, train_size=64):
    """Every variant has a row of finite, positive times (and peak memory), finite effects."""
    assert set(ablation) == {"eval_size", "train_size", "rows", "samples"}
    assert ablation["eval_size"] == [64, 96] and ablation["train_size"] == train_size
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
    """--ablate --v2 only: SwinV2Backbone's ablation alone, with memory measured by the V2 memory
    child (``--memory-child v2:ours --ablate-variant V``)."""
    results, stdout = _run(tmp_path, "--ablate", "--v2", "only", "--only", "lean saves",
                           "--train-size", "256")  # (as V1's above)
    assert "ablation" not in results  # 'only': no V1 ablation
    rows = _check_ablation(results["v2_ablation"], {"no lean saves (norm / GELU outputs kept)"}, memory=True,
                           train_size=256)
    assert "Swin V2 ablation of SwinV2Backbone tiny, window 8" in stdout
    for name in rows:
        assert name in stdout
    # The switch reaches V2's blocks too: without lean saves their GELU outputs are kept.
    assert rows["no lean saves (norm / GELU outputs kept)"]["peak_bytes"] > rows["defaults"]["peak_bytes"]


def test_only_picks_the_variants_of_both_ablations():
    # --only's words pick variants by substring, from V1's and V2's lists alike, in their order.
    chosen = ["no SDPA (matmul attention)", "row chunks x0.5"]
    assert benchmark.ablation_variants(ABLATIONS, ["x0.5", "SDPA"]) == chosen
    assert benchmark.ablation_variants(V2_ABLATIONS, ["x0.5", "SDPA"]) == chosen
    assert benchmark.ablation_variants(ABLATIONS, None) == list(ABLATIONS)


def test_v2_ablation_runs_each_variant_on_the_v2_model(monkeypatch):
    """In process: every forward of the V2 ablation runs SwinV2Backbone (never V1's model) under
    its variant's planner switches, in eval and in training."""
    from swin_backbone import SwinV2Backbone, ops

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

    real_build_v2 = benchmarking.build_v2
    monkeypatch.setattr(benchmarking, "build_v2", build_v2)
    monkeypatch.setattr(benchmarking, "build_pair", build_pair)
    monkeypatch.setattr(benchmarking, "peak_memory", peak_memory)
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
    def build(*args, **kwargs):
        raise AssertionError("built a model for an --only that matches no variant")

    monkeypatch.setattr(benchmarking, "build_pair", build)
    monkeypatch.setattr(benchmarking, "build_v2", build)
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
    args = argparse.Namespace(device="cpu", iters=1, warmup=0, no_peers=False, skip_memory=True)
    results = {}
    benchmark.run_cuda_v2(args, results, size=(32, 32))
    keys = [f"v2_eval_{t}_{b}x3x32x32" for t, b in (("bf16", 1), ("bf16", 8), ("fp32-ieee", 1))]
    keys += ["v2_train_bf16_2x3x32x32", "v2_train_fp32-ieee_2x3x32x32"]
    _check_rows(results, keys, {"ours", "timm", "torchvision"})


def _tf32_state():
    return tuple(getattr(ns, name) for ns, name, _, _ in benchmarking.tf32_flags())


def test_tf32_sets_and_restores_torch_switches():
    """TF32 on / off for cuBLAS matmuls and cuDNN convolutions, restored on exit (also after an
    error), through ``fp32_precision`` where torch has it (the legacy ``allow_tf32`` raises once
    that was used)."""
    flags = benchmarking.tf32_flags()
    before = _tf32_state()
    for enabled in (True, False):
        with benchmarking.tf32(enabled):
            assert _tf32_state() == tuple(on if enabled else off for _, _, on, off in flags)
        assert _tf32_state() == before
    with pytest.raises(RuntimeError):
        with benchmarking.tf32(True):
            raise RuntimeError
    assert _tf32_state() == before
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert [name for _, name, _, _ in flags] == ["fp32_precision", "fp32_precision"]
        assert [on for _, _, on, _ in flags] == ["tf32", "tf32"] and [off for *_, off in flags] == ["ieee", "ieee"]


def test_peak_memory_returns_cached_cuda_memory_before_the_child(monkeypatch):
    """On CUDA the parent empties its allocator cache before it starts a memory child (its cached
    blocks would compete with the child for the GPU); on the CPU there is nothing to empty."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd[cmd.index("--memory-child") + 1])
        return subprocess.CompletedProcess(cmd, 0, stdout='{"peak_bytes": 123}\n')

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(benchmarking.subprocess, "run", run)
    assert benchmarking.peak_memory("ours", "cuda", 2, (64, 64), dtype="bfloat16") == 123
    assert calls == ["empty_cache", "ours"]
    calls.clear()
    assert benchmarking.peak_memory("mmdet", "cpu", 2, (64, 64)) == 123
    assert calls == ["mmdet"]


def _check_v1_row(row, models, key):
    assert set(row["samples"]) == set(models), key
    assert all(len(v) >= 1 and all(t > 0 for t in v) for v in row["samples"].values()), key
    assert set(row["speedup_over_mmdet"]) == set(models) - {"mmdet"}, key
    assert row["speedup"] > 0 and row["ours_s"] > 0 and row["mmdet_s"] > 0, key


def test_benchmark_cuda_rows_run_on_the_cpu(monkeypatch):
    """The CUDA run's V1 rows through the same code on the CPU, tiny, ``--compile`` included
    (``torch.compile`` stood in for: compiling takes minutes on a CPU): every row and key
    exists; the fp32 rows ran with TF32 as labelled, restored after; mmdet and ours compiled,
    dynamic, ours in its compiled mode, then with CUDA graphs; memory children for mmdet and ours."""
    built = {}
    fp32_states = []  # TF32 switches at each forward of ours without autocast

    def build_pair(*args, **kwargs):
        built.update(real_build_pair(*args, **kwargs))

        def record(module, inputs):
            if not torch.is_autocast_enabled("cpu"):
                fp32_states.append(_tf32_state())

        built["ours"].register_forward_pre_hook(record)
        return dict(built)

    class Compiled(torch.nn.Module):
        def __init__(self, model, kwargs):
            super().__init__()
            self.model, self.kwargs, self.calls = model, kwargs, 0

        def forward(self, x, **kw):
            self.calls += 1
            return self.model(x, **kw)

    compiled = []

    def compile_model(model, **kwargs):
        compiled.append(Compiled(model, kwargs))
        return compiled[-1]

    children = []

    def peak_memory(name, device, batch, size, variant=None, dtype=None):
        children.append((name, device, batch, tuple(size), variant, dtype))
        return 2**20

    regional = []

    def regional_model(model, **options):
        regional.append(Compiled(model, options))
        return regional[-1]

    real_build_pair = benchmarking.build_pair
    monkeypatch.setattr(benchmarking, "build_pair", build_pair)
    monkeypatch.setattr(benchmarking, "compile_model", compile_model)
    monkeypatch.setattr(benchmarking, "regional_model", regional_model)
    monkeypatch.setattr(benchmarking, "peak_memory", peak_memory)
    before = _tf32_state()
    args = argparse.Namespace(device="cpu", iters=1, warmup=0, no_peers=True, skip_memory=False, compile=True,
                              upernet=None, padded=None)
    results = {}
    benchmark.run_cuda(args, results, size=(64, 96))

    pair = {"mmdet", "ours"}
    for t, b in (("bf16", 1), ("bf16", 8), ("fp32-ieee", 1), ("fp32-tf32", 1)):
        _check_v1_row(results[f"eval_{t}_{b}x3x64x96"], pair, t)
    for t in ("bf16", "fp32-ieee", "fp32-tf32"):
        _check_v1_row(results[f"train_{t}_2x3x64x96"], pair, t)
    for kind in ("eval", "train"):
        assert results[f"{kind}_fp32-ieee_{1 if kind == 'eval' else 2}x3x64x96"]["tf32"] is False
        assert results[f"{kind}_fp32-tf32_{1 if kind == 'eval' else 2}x3x64x96"]["tf32"] is True
        assert "tf32" not in results[f"{kind}_bf16_{1 if kind == 'eval' else 2}x3x64x96"]
    flags = benchmarking.tf32_flags()
    ieee, on = tuple(off for *_, off in flags), tuple(on for _, _, on, _ in flags)
    assert set(fp32_states) == {ieee, on}  # fp32 rows: explicitly off, or on
    assert _tf32_state() == before

    # Memory: each of the pair in its own child, bf16 training.
    assert children == [(k, "cpu", 2, (64, 96), None, "bfloat16") for k in ("mmdet", "ours")]
    assert results["peak_memory"]["ratio"] == 1.0

    # Image-exact batches.
    for kind in ("eval", "train"):
        row = results[f"valid_sizes_overhead_{kind}_bf16_2x3x64x96"]
        assert set(row["samples"]) == {"without", "valid_sizes"} and row["overhead"] > -1
        assert [tuple(s) for s in row["sizes"]] == [(64, 79), (14, 96)]

    # Which attention ran: every profiled step, with its counts.
    kernels = results["sdpa_kernels"]
    assert set(kernels) == {"eval_bf16", "eval_bf16_valid_sizes", "train_bf16", "train_fp32-ieee",
                            "compiled_eval_bf16", "compiled_train_bf16"}
    counts = ("sdpa_calls", "inductor_triton_launches", "constant_pad_nd", "copy_", "constant_pad_nd_in_sdpa",
              "copy_in_sdpa")
    for name, row in kernels.items():
        assert row["step"] == ("forward+backward" if "train" in name else "forward"), name
        assert all(isinstance(row[c], int) and row[c] >= 0 for c in counts), name
        assert row["constant_pad_nd_in_sdpa"] <= row["constant_pad_nd"] and row["copy_in_sdpa"] <= row["copy_"]
    assert kernels["eval_bf16"]["sdpa_calls"] > 0  # CPU inference: SDPA
    assert "aten::scaled_dot_product_attention" in kernels["eval_bf16"]["kernels"]

    # --compile: mmdet and ours (dynamic), then CUDA graphs at batch 1; each compiled model ran.
    assert [c.kwargs for c in compiled] == [dict(dynamic=True)] * 2 + [dict(mode="reduce-overhead", dynamic=False)] * 2
    assert [c.model for c in compiled] == [built["mmdet"], built["ours"]] * 2
    assert all(c.calls > 0 for c in compiled)
    # and ours in its compiled mode (compile=True: its regions compiled), the first call timed
    assert [c.model for c in regional] == [built["ours"]] and regional[0].calls > 0
    for key in ("compiled_eval_bf16_8x3x64x96", "compiled_train_bf16_2x3x64x96"):
        _check_v1_row(results[key], {"mmdet", "ours", "ours_regional"}, key)
        assert set(results[key]["first_call_s"]) == {"mmdet", "ours", "ours_regional"}
    row = results["compiled_reduce_overhead_eval_bf16_1x3x64x96"]
    _check_v1_row(row, {"mmdet", "ours", "mmdet_eager", "ours_eager"}, "reduce-overhead")
    assert set(row["ours_speedup_over"]) == {"mmdet_eager", "ours_eager"} and row["cudagraph_skips"] == 0


def test_v2_rows_share_their_weights():
    """ours, timm's and torchvision's V2-T of the V2 rows compute the same features from the same
    weights (at 256x256, where all three place the same windows in stages 1-3)."""
    pytest.importorskip("timm")
    models = benchmarking.build_v2("cpu", (256, 256))
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


def test_saved_results_rewrite_the_json_as_rows_finish(tmp_path):
    """--json: every row added rewrites the file, so a run cut short (a time limit) keeps its rows."""
    from swin_backbone.tools.benchmarking import SavedResults

    path = tmp_path / "b.json"
    results = SavedResults(str(path))
    results["a"] = {"samples": {"ours": [0.1]}}
    assert json.loads(path.read_text()) == {"a": {"samples": {"ours": [0.1]}}}
    results["b"] = [(64, 79), (14, 96)]
    assert json.loads(path.read_text()) == {"a": {"samples": {"ours": [0.1]}}, "b": [[64, 79], [14, 96]]}
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # (no temporary file left)


def test_benchmark_cuda_compile_only_runs_just_the_compiled_rows(monkeypatch):
    # `--compile only`: a device call of its own for the compiled rows (no eager rows, no
    # memory children), so the GPU run can be split over calls of 10 minutes.
    # (compiling stood in for, both ways: which rows run is the point; tests/model/test_compiled.py compiles)
    monkeypatch.setattr(benchmarking, "compile_model", lambda model, **kwargs: model)
    monkeypatch.setattr(benchmarking, "regional_model", lambda model, **options: model)
    monkeypatch.setattr(benchmarking, "peak_memory", lambda *a, **k: pytest.fail("no memory rows with --compile only"))
    args = argparse.Namespace(device="cpu", iters=1, warmup=0, no_peers=True, skip_memory=False, compile="only",
                              upernet=None, padded=None)
    results = {}
    benchmark.run_cuda(args, results, size=(64, 96))
    rows = {k for k in results if k not in ("sdpa_kernels", "gpu")}
    assert rows and all(k.startswith("compiled_") for k in rows), sorted(results)
    assert set(results["sdpa_kernels"]) == {"compiled_eval_bf16", "compiled_train_bf16"}


def test_report_is_a_cuda_option(capsys):
    # swin-benchmark --device cuda --report is the GPU report; without CUDA it says so in one
    # line (naming --device) and exits non-zero, before building anything.
    from swin_backbone.tools import benchmark

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_info:
        benchmark.parse_args(["--device", "cuda", "--report"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--device" in err and "CUDA is not available" in err
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--device", "cpu", "--report"])
    assert "--report: the GPU report; expected it with --device cuda" in capsys.readouterr().err


def test_padded_only_runs_the_padded_batch_rows(tmp_path):
    """``--padded only``: a landscape and a portrait image padded together as mmdet pads them (to
    the longer side, a multiple of 32), eval and training: mmdet on the batch, ours with
    valid_sizes, ours without, in the same rounds; nothing else runs."""
    args = benchmark.parse_args(["--device", "cpu", "--padded", "only", "--padded-size", "24", "40", "--iters", "1",
                                 "--warmup", "0", "--json", str(tmp_path / "p.json")])
    results = benchmark.run(args)
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(json.dumps(results))
    rows = {k for k in results if k.startswith("padded_")}
    assert rows == {"padded_eval_fp32_2x3x64x64", "padded_train_fp32_2x3x64x64"}
    assert not {"forward_eval", "forward_backward", "peak_memory", "valid_sizes_overhead"} & set(results)
    for key in rows:
        row = results[key]
        assert set(row["samples"]) == {"mmdet", "ours", "ours_without_valid_sizes"}
        assert [tuple(s) for s in row["sizes"]] == [(24, 40), (40, 24)]
        assert row["padding"] == pytest.approx(1 - 2 * 24 * 40 / (2 * 64 * 64))
        assert row["ours_speedup_over"]["ours_without_valid_sizes"] > 0 and row["speedup"] > 0


def test_padded_pair_is_zero_beyond_each_image():
    x, sizes = benchmark.padded_pair((800, 1333), "cpu")
    assert x.shape == (2, 3, 1344, 1344) and sizes == [(800, 1333), (1333, 800)]
    for image, (h, w) in zip(x, sizes):
        assert image[:, :h, :w].abs().min() > 0 or image[:, :h, :w].std() > 0.5
        assert image[:, h:].abs().sum() == 0 and image[:, :, w:].abs().sum() == 0
    assert 1 - 2 * 800 * 1333 / (2 * 1344**2) == pytest.approx(0.41, abs=0.005)  # the 41%


def test_gpu_report_smoke_on_the_cpu(tmp_path, monkeypatch):
    """The prepared GPU script end to end on the CPU, tiny (``torch.compile`` stood in for: it
    takes minutes on a CPU; memory children stood in for, see the next test): every row of its
    docstring for ours, mmdet, timm and torchvision, the JSON, and the Markdown table."""
    compiled, regional, children = [], [], []

    def compile_model(model, **kwargs):
        compiled.append(kwargs)
        return model

    def regional_model(model, **options):
        regional.append(options)
        return model

    def peak_memory(name, device, batch, size, variant=None, dtype=None):
        children.append((name, tuple(size), dtype))
        return 2**20 * (2 if name == "mmdet" else 1)

    monkeypatch.setattr(benchmarking, "compile_model", compile_model)
    monkeypatch.setattr(benchmarking, "regional_model", regional_model)
    monkeypatch.setattr(benchmarking, "peak_memory", peak_memory)
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    assert gpu_report.main(["--device", "cpu", "--size", "32", "32", "--padded-size", "16", "32", "--iters", "1",
                            "--warmup", "0", "--budget", "60", "--json", str(out), "--markdown", str(md)]) == 0
    results = json.loads(out.read_text())
    everyone = {"mmdet", "ours", "timm", "torchvision"}
    for key in ("eval_bf16_1x3x32x32", "eval_bf16_8x3x32x32", "train_bf16_2x3x32x32"):
        assert set(results[key]["samples"]) == everyone, key
    assert sorted(children) == sorted((k, (32, 32), "bfloat16") for k in everyone)
    assert results["peak_memory"]["ratio_over_mmdet"] == 0.5
    for key in ("padded_eval_bf16_2x3x32x32", "padded_train_bf16_2x3x32x32"):
        assert set(results[key]["samples"]) == {"mmdet", "ours", "ours_without_valid_sizes"}
    lean = results["lean_saves_train_bf16_2x3x32x32"]
    assert set(lean["samples"]) == {"mmdet", "ours", "ours_save_memory"}
    assert not any("split_masks" in key for key in results)
    assert "peak_bytes" not in lean  # (CUDA only: the process's own peak)
    # stochastic depth at the configs' rate: mmdet and ours at 0.2, ours at 0 beside them
    assert set(results["drop_path_0.2_train_bf16_2x3x32x32"]["samples"]) == {"mmdet", "ours", "ours_rate_0"}
    host = results["host_time"]
    assert host["size"] == "3x32x32"
    for key in ("mmdet_eval_1x", "ours_eval_1x", "mmdet_train_2x", "ours_train_2x"):
        assert 0 < host[key]["host_s"] <= host[key]["step_s"], key
    for key in ("compiled_eval_bf16_8x3x32x32", "compiled_train_bf16_2x3x32x32"):
        # mmdet compiled, ours with compile=True, ours eager (the whole of ours is not compiled here)
        assert set(results[key]["samples"]) == {"mmdet", "ours_eager", "ours_regional"}
    # CUDA graphs last: mmdet compiled with them, ours compiled whole and by regions
    # (compile=dict(mode=..., dynamic=False[, regions=False])), ours eager
    graphed = {"mmdet", "ours_whole", "ours_eager", "ours_regional"}
    for key in ("compiled_reduce_overhead_train_bf16_2x3x32x32", "compiled_reduce_overhead_eval_bf16_1x3x32x32"):
        assert set(results[key]["samples"]) == graphed, key
        assert results[key]["cudagraph_skips"] >= 0 and set(results[key]["first_call_s"]) == graphed
    assert "cudagraphs_error" not in results
    assert compiled == [dict(dynamic=False), gpu_report.CUDA_GRAPHS]  # mmdet alone (ours through its own option)
    assert regional == [{}, dict(gpu_report.CUDA_GRAPHS, regions=False), gpu_report.CUDA_GRAPHS]
    assert gpu_report.CUDA_GRAPHS == dict(mode="reduce-overhead", dynamic=False)
    assert results["skipped"] == [] and results["environment"]["torch"] == torch.__version__
    table = md.read_text().splitlines()
    assert table[2].startswith("| measure | mmdet ") and "| SwinBackbone " in table[2]
    lines = {line.split(" | ")[0][2:] for line in table if line.startswith("| ") and "---" not in line}
    assert {"eval bf16 1x3x32x32", "eval bf16 8x3x32x32", "train fwd+bwd bf16 2x3x32x32",
            "peak training memory bf16 2x3x32x32", "torch.compile eval bf16 8x3x32x32",
            "torch.compile train fwd+bwd bf16 2x3x32x32",
            "torch.compile train fwd+bwd bf16 2x3x32x32, ours compile=True (regions compiled)",
            "torch.compile reduce overhead train fwd+bwd bf16 2x3x32x32, ours compile=dict(mode='reduce-overhead', "
            "dynamic=False) (regions compiled)",
            "torch.compile reduce overhead eval bf16 1x3x32x32, ours eager",
            "torch.compile eval bf16 8x3x32x32, ours eager",
            "lean saves train fwd+bwd bf16 2x3x32x32", "lean saves train fwd+bwd bf16 2x3x32x32, ours save_memory=True",
            "drop path 0.2 train fwd+bwd bf16 2x3x32x32", "drop path 0.2 train fwd+bwd bf16 2x3x32x32, ours at rate 0",
            "padded eval bf16 2x3x32x32 (images 16x32 + 32x16, 50% padding)",
            "padded eval bf16 2x3x32x32 (images 16x32 + 32x16, 50% padding), ours without valid_sizes",
            "host time of a step, eval bf16 1x3x32x32 (until its Python returns, of the step)",
            "host time of a step, train fwd+bwd bf16 2x3x32x32 (until its Python returns, of the step)"} <= lines


def test_gpu_report_skips_what_the_budget_leaves_no_time_for(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarking, "build_pair", lambda device: {})
    monkeypatch.setattr(benchmarking, "build_peers", lambda device, size: {})
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    assert gpu_report.main(["--device", "cpu", "--budget", "0", "--json", str(out), "--markdown", str(md)]) == 0
    assert len(json.loads(out.read_text())["skipped"]) == len(gpu_report.STEPS) == 8
    assert "Not run: torch.compile rows (the 0.0 min budget was spent)" in md.read_text()


def test_gpu_report_runs_the_steps_asked_for(tmp_path, monkeypatch, capsys):
    """``--steps`` runs those steps alone (a device call of their own), and names the steps
    it knows when given another."""
    monkeypatch.setattr(benchmarking, "regional_model", lambda model, **options: model)
    monkeypatch.setattr(benchmarking, "compile_model", lambda model, **options: model)
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    assert gpu_report.main(["--device", "cpu", "--size", "32", "32", "--iters", "1", "--warmup", "0",
                            "--steps", "cudagraphs, host", "--json", str(out), "--markdown", str(md)]) == 0
    results = json.loads(out.read_text())
    rows = {k for k, v in results.items() if isinstance(v, dict) and ("samples" in v or k == "host_time")}
    assert rows == {"host_time", "compiled_reduce_overhead_train_bf16_2x3x32x32",
                    "compiled_reduce_overhead_eval_bf16_1x3x32x32"}
    assert results["skipped"] == []
    for bad, given in (("host,cudagraph", "['cudagraph']"), (",", "[]")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_report.parse_args(["--device", "cpu", "--steps", bad])
        assert exit_info.value.code == 2
        assert f"--steps: expected comma-separated names of rows, memory, padded, lean, drop_path, host, compile, " \
               f"cudagraphs, got {given}" in capsys.readouterr().err


def test_memory_child_of_a_peer():
    """The memory child builds timm's and torchvision's Swin-T too (the prepared GPU run's memory row),
    in a fresh process as the benchmark runs it (in this one, earlier tests' memory hides the growth)."""
    assert benchmarking.peak_memory("torchvision", "cpu", 1, (64, 64)) > 0
