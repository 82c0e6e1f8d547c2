"""swin-benchmark runs end to end (tiny sizes) and prints and writes what it promises; the
developer harness in tools/analysis_tools (``make bench``) runs its rows and writes its JSON."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from swin_backbone.tools import benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(ROOT, "tools", "analysis_tools")
sys.path.insert(0, HARNESS)

import benchmark as harness  # noqa: E402  (tools/analysis_tools/benchmark.py)
import benchmarking  # noqa: E402
import gpu_report  # noqa: E402

# The benchmark end to end, its memory measurements in fresh processes: out of `make test-fast`.
pytestmark = pytest.mark.slow

TINY = ["--device", "cpu", "--size", "32", "32", "--iters", "2", "--warmup", "0"]


# ------------------------------------------------------------------------- swin-benchmark
def test_swin_benchmark_compares_every_installed_model(tmp_path, capsys, one_thread):
    pytest.importorskip("mmdet")
    out = tmp_path / "b.json"
    assert benchmark.main([*TINY, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    models = {"mmdet", "ours"} | {lib for lib in ("timm", "torchvision") if benchmark.installed(lib)}
    for kind in ("eval", "train"):
        row = results[kind]
        assert set(row["samples"]) == models and all(len(v) == 2 and min(v) > 0 for v in row["samples"].values())
        assert set(row["speedup_over_mmdet"]) == models - {"mmdet"} and row["speedup"] > 0
    assert results["eval"]["label"] == "eval fp32 1x3x32x32"
    assert results["train"]["label"] == "train fwd+bwd fp32 2x3x32x32"
    assert results["arch"] == "tiny" and results["dtype"] == "fp32" and results["size"] == [32, 32]
    assert "train_peak_bytes" not in results  # (CUDA only)
    stdout = capsys.readouterr().out
    table = stdout[stdout.index("\nmodel "):].splitlines()[1:]
    assert table[0].split(" | ")[1:] == ["eval fp32 1x3x32x32 ms", "speedup", "train fwd+bwd fp32 2x3x32x32 ms",
                                          "speedup"]
    rows = {line.split(" | ")[0].strip(): line.split(" | ") for line in table[2:2 + len(models)]}
    assert set(rows) == models and rows["mmdet"][2].strip() == "1.00x"
    ours = rows["ours"]
    assert float(ours[1]) == pytest.approx(results["eval"]["median_s"]["ours"] * 1e3, abs=0.06)
    assert ours[4].strip() == f"{results['train']['speedup_over_mmdet']['ours']:.2f}x"
    assert f"wrote {out}" in stdout


def test_swin_benchmark_without_mmdet_compares_with_ours(tmp_path, capsys, monkeypatch, one_thread):
    # A plain install: ours alone, the ratios against ours, one line naming what was skipped.
    real = benchmark.installed
    monkeypatch.setattr(benchmark, "installed", lambda lib: lib != "mmdet" and real(lib))
    assert benchmark.main([*TINY, "--no-peers", "--iters", "1", "--dtype", "bf16", "--arch", "small"]) == 0
    stdout = capsys.readouterr().out
    skipped = [line for line in stdout.splitlines() if line.startswith("skipped (not installed): ")]
    assert len(skipped) == 1 and ": mmdet (pip install 'swin-backbone[mmdet]')" in skipped[0]
    assert "timm" not in skipped[0]  # --no-peers: not wanted, so not missed
    assert "eval bf16 1x3x32x32: ours " in stdout and "speedup: ours's time / the model's" in stdout


def test_the_table_shows_cuda_peak_memory_against_mmdet():
    times = {"mmdet": [0.02, 0.02], "ours": [0.01, 0.01]}
    results = {"iters": 2, "train_peak_bytes": {"mmdet": 4 * 2**20, "ours": 3 * 2**20}}
    for kind in ("eval", "train"):
        results[kind] = dict(benchmark.summarize(kind, times), label=f"{kind} bf16 1x3x8x8")
    lines = benchmark.table(results)
    assert lines[1].endswith("| train peak MiB | / mmdet")
    assert [c.strip() for c in lines[3].split(" | ")] == ["mmdet", "20.0", "1.00x", "20.0", "1.00x", "4", "1.00x"]
    assert [c.strip() for c in lines[4].split(" | ")] == ["ours", "10.0", "2.00x", "10.0", "2.00x", "3", "0.75x"]
    assert len({len(line) for line in lines[1:5]}) == 1  # the columns line up
    assert lines[-1].endswith("; peak memory / mmdet's")


def test_peers_and_pair_are_built_as_asked():
    """``--arch`` picks the size of ours and mmdet's (the same weights: the same features); the
    user rows' peers train without stochastic depth."""
    pytest.importorskip("mmdet")
    pair = benchmark.build_pair("cpu", arch="small")
    assert len(pair["ours"].stages[2].blocks) == 18 and pair["ours"].embed_dims == 96  # Swin-S
    assert len(pair["mmdet"].stages[2].blocks) == 18
    # ours loaded mmdet's weights (in its own layout: the same numbers, whatever their names)
    totals = [sum(p.double().sum().item() for p in m.parameters()) for m in pair.values()]
    assert totals[0] == pytest.approx(totals[1], rel=1e-9)
    peers = benchmark.build_peers("cpu", (32, 32), "tiny", drop_path_rate=0.0)
    rates = [m.p if hasattr(m, "p") else m.drop_prob for m in
             (m for p in peers.values() for m in p.modules()) if type(m).__name__ in ("StochasticDepth", "DropPath")]
    assert rates and set(rates) == {0.0}


# ---------------------------------------------------------- the developer harness (make bench)
def test_make_bench_rows_run_and_write_their_json(tmp_path, capsys, one_thread):
    """The default rows of ``make bench`` (the CPU run), tiny; memory: the next test."""
    pytest.importorskip("mmdet")
    out = tmp_path / "bench.json"
    assert harness.main(["--device", "cpu", "--iters", "1", "--warmup", "0", "--eval-size", "64", "64",
                         "--train-size", "32", "--skip-memory", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["forward_eval"]["samples"]) >= {"ours", "mmdet"}
    assert set(results["forward_backward"]["samples"]) == {"ours", "mmdet"}
    assert results["flops"]["gflop"] > 0 and results["valid_sizes_overhead"]["overhead"] > -1
    stdout = capsys.readouterr().out
    for line in ("forward eval 1x3x64x64", "forward+backward train 2x3x32x32", "FLOPs", "valid_sizes overhead"):
        assert line in stdout


def test_memory_child_runs_the_harness_script():
    """Peak memory of a training step in a fresh process, as ``make bench`` measures it."""
    assert benchmarking.peak_memory("ours", "cpu", 1, (32, 32)) > 0


def test_harness_ablation_and_padded_rows(tmp_path, capsys, one_thread):
    args = harness.parse_args(["--device", "cpu", "--ablate", "--only", "x2", "--iters", "1", "--warmup", "0",
                               "--eval-size", "32", "32", "--train-size", "32", "--skip-memory"])
    rows = harness.run(args)["ablation"]["rows"]
    assert set(rows) == {"defaults", "row chunks x2"} and rows["row chunks x2"]["eval_s"] > 0
    assert "row chunks x2" in capsys.readouterr().out
    pytest.importorskip("mmdet")
    args = harness.parse_args(["--device", "cpu", "--padded", "only", "--padded-size", "24", "40", "--iters", "1",
                               "--warmup", "0", "--json", str(tmp_path / "p.json")])
    results = harness.run(args)
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(json.dumps(results))
    for key in ("padded_eval_fp32_2x3x64x64", "padded_train_fp32_2x3x64x64"):
        assert set(results[key]["samples"]) == {"mmdet", "ours", "ours_without_valid_sizes"}
        assert results[key]["padding"] == pytest.approx(1 - 2 * 24 * 40 / (2 * 64 * 64))


def test_harness_cuda_rows_run_on_the_cpu(monkeypatch, one_thread):
    """The CUDA run's rows through the same code on the CPU, tiny, memory children stood in for."""
    pytest.importorskip("mmdet")
    monkeypatch.setattr(benchmarking, "peak_memory", lambda name, *a, **k: 2**20)
    args = argparse.Namespace(device="cpu", iters=1, warmup=0, no_peers=True, skip_memory=False, compile=None,
                              upernet=None, padded=None)
    results = {}
    harness.run_cuda(args, results, size=(56, 24))  # (the valid-sizes rows cut 50 rows and 17 columns)
    for t, b in (("bf16", 1), ("bf16", 8), ("fp32-ieee", 1), ("fp32-tf32", 1)):
        assert set(results[f"eval_{t}_{b}x3x56x24"]["samples"]) == {"mmdet", "ours"}
    assert results["peak_memory"]["ratio"] == 1.0
    assert results["sdpa_kernels"]["eval_bf16"]["sdpa_calls"] > 0


def test_gpu_report_runs_the_steps_asked_for(tmp_path, capsys, monkeypatch, one_thread):
    pytest.importorskip("mmdet")
    monkeypatch.setattr(benchmarking, "build_peers", lambda device, size: {})  # (the host step times the pair)
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    assert gpu_report.main(["--device", "cpu", "--size", "32", "32", "--iters", "1", "--warmup", "0",
                            "--steps", "host", "--json", str(out), "--markdown", str(md)]) == 0
    results = json.loads(out.read_text())
    assert 0 < results["host_time"]["ours_eval_1x"]["host_s"] <= results["host_time"]["ours_eval_1x"]["step_s"]
    assert "| host time of a step, eval bf16 1x3x32x32" in md.read_text()
    with pytest.raises(SystemExit):
        gpu_report.parse_args(["--device", "cpu", "--steps", "host,nothing"])
    assert "--steps: expected comma-separated names of" in capsys.readouterr().err


def test_tf32_sets_and_restores_torch_switches():
    flags = benchmarking.tf32_flags()
    state = lambda: tuple(getattr(ns, name) for ns, name, _, _ in flags)  # noqa: E731
    before = state()
    for enabled in (True, False):
        with benchmarking.tf32(enabled):
            assert state() == tuple(on if enabled else off for _, _, on, off in flags)
        assert state() == before
    with pytest.raises(RuntimeError):
        with benchmarking.tf32(True):
            raise RuntimeError
    assert state() == before


def test_peak_memory_runs_the_harness_child_after_emptying_the_cuda_cache(monkeypatch):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd[1:3])
        return subprocess.CompletedProcess(cmd, 0, stdout='{"peak_bytes": 123}\n')

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(benchmarking.subprocess, "run", run)
    assert benchmarking.peak_memory("ours", "cuda", 2, (64, 64), dtype="bfloat16") == 123
    assert calls == ["empty_cache", [os.path.join(HARNESS, "benchmark.py"), "--memory-child"]]
