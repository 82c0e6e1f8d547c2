"""The block and the forward stay readable: which package files and functions a forward enters
(``sys.setprofile``, warm caches, CPU), the counts docs/design.md gives and their goals."""
import os
import sys
from typing import Callable, List, Tuple

import pytest
import torch

import swin_backbone
from swin_backbone import SwinBackbone
from swin_backbone.torch_compat import AUTOCAST_BY_DEVICE

PKG = os.path.dirname(os.path.abspath(swin_backbone.__file__))
Call = Tuple[str, str, int]
#: Before torch 2.4 the version shims of torch_compat.py (the autocast queries, is_compiling) are
#: Python frames of ours; the goals count the model and its ops, so there those frames are left out.
SHIMS = () if AUTOCAST_BY_DEVICE else ("torch_compat.py",)


def traced_calls(run: Callable[[], object]) -> List[Call]:
    """The package functions ``run`` enters, in order: ``(file, name, first line)``."""
    calls: List[Call] = []

    def prof(frame, event, arg):
        if event == "call":
            f = os.path.abspath(frame.f_code.co_filename)
            if f.startswith(PKG) and os.path.relpath(f, PKG) not in SHIMS:
                calls.append((os.path.relpath(f, PKG), frame.f_code.co_name, frame.f_code.co_firstlineno))

    sys.setprofile(prof)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def returns_to_a_file_left(calls: List[Call]) -> int:
    files: List[str] = []
    returns = 0
    for f, *_ in calls:
        if not files or files[-1] != f:
            returns += f in files
            files.append(f)
    return returns


def model() -> SwinBackbone:
    torch.manual_seed(0)
    return SwinBackbone(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), drop_path_rate=0.0)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_one_block_reads_in_blocks_py_and_its_ops(training):
    # The shifted block of stage 0; in training autograd calls the lean-saves hook too.
    m, x = model().train(training), torch.randn(1, 3, 120, 100)
    block, calls = m.stages[0].blocks[1], []
    forward = block.forward

    def traced_forward(*args):
        out = []
        calls.extend(traced_calls(lambda: out.append(forward(*args))))
        return out[0]

    block.forward = traced_forward
    with torch.set_grad_enabled(training):
        m(x)
        calls.clear()
        m(x)
    files = {c[0] for c in calls}
    assert files == {"model/blocks.py", "ops/attention.py"}, sorted(files)
    assert len(set(calls)) <= 10, sorted(set(calls))
    assert returns_to_a_file_left(calls) <= (2 if training else 0), calls
    assert ("ops/attention.py", "forward") in {c[:2] for c in calls}  # DropPath ran as its module


def test_a_forward_enters_six_files_and_twenty_functions():
    m, x = model().eval(), torch.randn(1, 3, 120, 100)
    with torch.no_grad():
        m(x)
        calls = traced_calls(lambda: m(x))
    assert len({c[0] for c in calls}) <= 6, sorted({c[0] for c in calls})
    assert len(set(calls)) <= 20, sorted(set(calls))


def test_the_counter_sees_a_bounce():
    # The measure itself: a -> b -> a is one return, a -> b -> c none.
    assert returns_to_a_file_left([("a", "f", 1), ("b", "g", 1), ("a", "h", 2)]) == 1
    assert returns_to_a_file_left([("a", "f", 1), ("b", "g", 1), ("c", "h", 2)]) == 0
