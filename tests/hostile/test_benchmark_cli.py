"""Hostile command lines for swin-benchmark: each is refused up front (argparse's exit status
2, a message naming the option, what it expects and what it got), before any model is built
or timed. The measurements themselves are tests/tools/test_tools_benchmark.py's."""
import json
import os

import pytest
import torch

from swin_backbone.tools import benchmark
from swin_backbone.tools.benchmarking import SavedResults

CUDA = torch.cuda.is_available()

ROWS = [
    ("iters-zero", "--iters 0", ["--iters", ">= 1", "0"]),
    ("iters-negative", "--iters -3", ["--iters", ">= 1"]),
    ("iters-float", "--iters 2.5", ["--iters", "invalid int"]),
    ("warmup-negative", "--warmup -1", ["--warmup", ">= 0"]),
    ("warmup-word", "--warmup some", ["--warmup", "invalid int"]),
    ("eval-size-zero", "--eval-size 0 0", ["--eval-size", ">= 1", "0 0"]),
    ("eval-size-negative", "--eval-size -1 64", ["--eval-size", ">= 1"]),
    ("eval-size-one-value", "--eval-size 64", ["--eval-size", "2 arguments"]),
    ("eval-size-float", "--eval-size 64 64.5", ["--eval-size", "invalid int"]),
    ("train-size-negative", "--train-size -512", ["--train-size", ">= 1", "-512"]),
    ("train-size-zero", "--train-size 0", ["--train-size", ">= 1"]),
    ("upernet-size-zero", "--upernet-size 0", ["--upernet-size", ">= 1"]),
    ("batch-zero", "--batch 0", ["--batch", ">= 1"]),
    ("device-banana", "--device banana", ["--device", "invalid choice", "banana"]),
    ("device-indexed", "--device cuda:0", ["--device", "invalid choice"]),
    ("only-without-ablate", "--only SDPA", ["--only", "--ablate"]),
    ("only-matching-nothing", "--ablate --only nothing-like-this", ["--only", "variant names"]),
    ("upernet-missing", "--upernet no/such/config.py", ["--upernet", "no such config"]),
    ("json-is-a-folder", "--json .", ["--json", "file path"]),
    ("json-in-missing-folder", "--json no/such/folder/out.json", ["--json", "existing folder"]),
    ("v2-unknown", "--v2 sometimes", ["--v2", "invalid choice"]),
    ("compile-unknown", "--compile always", ["--compile", "invalid choice"]),
    ("compile-with-ablate", "--ablate --compile", ["--compile", "--ablate"]),
    ("padded-unknown", "--padded sometimes", ["--padded", "invalid choice"]),
    ("padded-size-zero", "--padded-size 0 1333", ["--padded-size", ">= 1", "0 1333"]),
    ("padded-with-ablate", "--ablate --padded", ["--padded", "--ablate"]),
    ("padded-with-v2-only", "--v2 only --padded only", ["--padded", "--v2 only"]),
    ("unknown-option", "--fast", ["unrecognized", "--fast"]),
]
if not CUDA:
    ROWS += [
        ("device-cuda-without-cuda", "--device cuda", ["--device", "CUDA is not available", "--device cpu"]),
    ]


@pytest.mark.parametrize("argv,says", [pytest.param(a, s, id=i) for i, a, s in ROWS])
def test_benchmark_usage_row(argv, says, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the benchmark started before refusing its arguments")

    monkeypatch.setattr(benchmark, "run", never)
    with pytest.raises(SystemExit) as exit_:
        benchmark.main(argv.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for word in says:
        assert word.lower() in err.lower(), (word, err)


def test_good_arguments_pass_the_checks():
    args = benchmark.parse_args(["--device", "cpu", "--iters", "1", "--warmup", "0", "--eval-size", "8", "8",
                                 "--ablate", "--only", "SDPA", "--upernet", "mmseg::x.py"])
    assert args.iters == 1 and args.eval_size == [8, 8] and args.only == ["SDPA"]
    assert benchmark.parse_args(["--device", "cpu", "--compile"]).compile == "also"  # CPU rows too


def test_a_failure_is_one_line_and_status_1(capsys, monkeypatch):
    def fail(args):
        raise RuntimeError("the measured step\nfailed")

    monkeypatch.setattr(benchmark, "run", fail)
    assert benchmark.main(["--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "swin-benchmark: error: RuntimeError: the measured step failed"


def test_saved_results_leave_no_temporary_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    results = SavedResults(str(path))
    results["kept"] = 1
    with pytest.raises(TypeError):
        results["row"] = object()  # not JSON
    del results["row"]
    monkeypatch.setattr(os, "replace", lambda *args: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        results["other"] = 2  # the rename into place fails
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
    assert json.loads(path.read_text()) == {"kept": 1}  # the last complete file
