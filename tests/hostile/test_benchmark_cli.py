"""Hostile command lines for swin-benchmark: each is refused up front (argparse's exit status
2, a message naming the option, what it expects and what it got), before any model is built
or timed. The measurements themselves are tests/tools/test_tools_benchmark.py's."""
import pytest
import torch

from swin_backbone.tools import benchmark

CUDA = torch.cuda.is_available()

ROWS = [
    ("iters-zero", "--iters 0", ["--iters", ">= 1", "0"]),
    ("iters-negative", "--iters -3", ["--iters", ">= 1"]),
    ("iters-float", "--iters 2.5", ["--iters", "invalid int"]),
    ("warmup-negative", "--warmup -1", ["--warmup", ">= 0"]),
    ("warmup-word", "--warmup some", ["--warmup", "invalid int"]),
    ("eval-batch-zero", "--eval-batch 0", ["--eval-batch", ">= 1", "0"]),
    ("train-batch-negative", "--train-batch -2", ["--train-batch", ">= 1", "-2"]),
    ("size-zero", "--size 0 0", ["--size", "multiples of 4", "0 0"]),
    ("size-negative", "--size -4 64", ["--size", "multiples of 4"]),
    ("size-not-a-patch-multiple", "--size 64 66", ["--size", "multiples of 4", "64 66"]),
    ("size-one-value", "--size 64", ["--size", "2 arguments"]),
    ("size-float", "--size 64 64.5", ["--size", "invalid int"]),
    ("arch-unknown", "--arch huge", ["--arch", "invalid choice", "huge"]),
    ("dtype-unknown", "--dtype int8", ["--dtype", "invalid choice", "int8"]),
    ("device-banana", "--device banana", ["--device", "invalid choice", "banana"]),
    ("device-indexed", "--device cuda:0", ["--device", "invalid choice"]),
    ("json-is-a-folder", "--json .", ["--json", "file path"]),
    ("json-in-missing-folder", "--json no/such/folder/out.json", ["--json", "existing folder"]),
    ("harness-option", "--ablate", ["unrecognized", "--ablate"]),
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
        benchmark.main(["--device", "cpu", *argv.split()] if "--device" not in argv else argv.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for word in says:
        assert word.lower() in err.lower(), (word, err)


def test_good_arguments_pass_the_checks_and_defaults_follow_the_device():
    args = benchmark.parse_args(["--device", "cpu", "--iters", "1", "--warmup", "0", "--size", "8", "12",
                                 "--arch", "base", "--dtype", "bf16"])
    assert (args.iters, args.warmup, args.size, args.arch, args.dtype) == (1, 0, [8, 12], "base", "bf16")
    args = benchmark.parse_args(["--device", "cpu"])
    assert (args.dtype, args.size, args.eval_batch, args.train_batch) == ("fp32", [512, 512], 1, 2)


def test_a_failure_is_one_line_and_status_1(capsys, monkeypatch):
    def fail(args):
        raise RuntimeError("the measured step\nfailed")

    monkeypatch.setattr(benchmark, "run", fail)
    assert benchmark.main(["--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "swin-benchmark: error: RuntimeError: the measured step failed"
