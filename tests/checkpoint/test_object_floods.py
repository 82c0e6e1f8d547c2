"""Pickles whose cheap opcodes make many objects: a byte of EMPTY_SET is a 216-byte set, a MEMOIZE
a memo entry, 5 bytes of memo references a tensor. Before the unpickler charged what it makes to
the load's budget (records.load_budget: the one materialize spends), a 3.9 MB file of empty sets
grew the process by 1 GB and one of tensor views by 800 MB; now each flood is refused with the
budget's message once what it made passes 4 times the file's size (plus records.LOAD_ALLOWANCE),
in a subprocess that reports its peak memory. Honest checkpoints, their pickle dense or not, load.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import textwrap
from typing import Callable, Dict, Tuple

import pytest
import torch

from swin_backbone.checkpoint import CheckpointError, read_checkpoint
from swin_backbone.checkpoint import records
from swin_backbone.checkpoint.records import RefusedError, load_budget
from swin_backbone.checkpoint.unpickler import InertUnpickler

from .pickles import FALSE, NONE, call, g, get, in_zip, legacy, program, put, t

#: What every flood's refusal says (records.spend's words).
BOUND = r"\d+ more bytes would pass what this load may make \(4 times the file's size\)"


def _short(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _into_a_list(items: bytes) -> bytes:
    return pickle.EMPTY_LIST + pickle.MARK + items + pickle.APPENDS


def _tensors(n: int) -> bytes:
    """``n`` tensors over the archive's storage ``0``, each one REDUCE of two memo references."""
    pid = t(_short("storage"), g("torch.FloatStorage"), _short("0"), _short("cpu"), pickle.BININT1 + b"\x04") \
        + pickle.BINPERSID
    args = t(pid, pickle.BININT1 + b"\0", t(pickle.BININT1 + b"\x04"), t(pickle.BININT1 + b"\x01"), FALSE,
             call(g("collections.OrderedDict")))
    return (g("torch._utils._rebuild_tensor_v2") + put(0) + pickle.POP + args + put(1) + pickle.POP
            + _into_a_list((get(0) + get(1) + pickle.REDUCE) * n))


#: name -> (the pickle body of a flood of ``n`` objects, ``n`` for a file of a few MB and under
#: MAX_OPCODES, what the refusal names: the opcode that made what passed the budget).
FLOODS: Dict[str, Tuple[Callable[[int], bytes], int, str]] = {
    "empty-sets": (lambda n: _into_a_list(pickle.EMPTY_SET * n), 3_900_000, r"sets \(EMPTY_SET\)"),
    "empty-dicts": (lambda n: _into_a_list(pickle.EMPTY_DICT * n), 3_900_000, r"dicts \(EMPTY_DICT\)"),
    "empty-lists": (lambda n: _into_a_list(pickle.EMPTY_LIST * n), 3_900_000, r"lists \(EMPTY_LIST\)"),
    "empty-tuples-on-the-stack": (lambda n: pickle.EMPTY_TUPLE * n, 3_900_000, r"stack \(EMPTY_TUPLE\)"),
    "marks": (lambda n: pickle.MARK * n, 3_900_000, r"marks \(MARK\)"),
    "nested-tuples": (lambda n: pickle.EMPTY_TUPLE + pickle.TUPLE1 * n, 3_900_000, r"tuples \(TUPLE1\)"),
    "dups": (lambda n: NONE + pickle.DUP * n, 3_900_000, r"stack \(DUP\)"),
    "short-strings-appended": (lambda n: pickle.EMPTY_LIST + (_short("ab") + pickle.APPEND) * n, 1_900_000,
                               r"(strings \(SHORT_BINUNICODE\)|list items \(APPEND\))"),
    "ints-appended": (lambda n: _into_a_list(b"".join(pickle.BININT + struct.pack("<i", 1000 + k) for k in range(n))),
                      1_500_000, r"ints \(BININT\)"),
    "memo-memoize": (lambda n: NONE + pickle.MEMOIZE * n, 3_900_000, r"memo \(MEMOIZE\)"),
    "memo-long-binput": (lambda n: NONE + b"".join(pickle.LONG_BINPUT + struct.pack("<I", k) for k in range(n)),
                         1_500_000, r"memo \(LONG_BINPUT\)"),
    # (each reference a stack slot and a list slot: 16 bytes for 2)
    "one-list-referenced-many-times": (lambda n: _into_a_list(NONE * 1000) + put(0) + pickle.POP
                                       + _into_a_list(get(0) * n), 1_900_000,
                                       r"(stack \(BINGET\)|list items \(APPENDS\))"),
    "ordered-dicts": (lambda n: g("collections.OrderedDict") + put(0) + pickle.POP
                      + _into_a_list((get(0) + pickle.EMPTY_TUPLE + pickle.REDUCE) * n), 1_300_000,
                      r"call results \(REDUCE\)"),
    "tensors-of-one-storage": (lambda n: _tensors(n), 1_200_000, r"call results \(REDUCE\)"),
}


@pytest.mark.parametrize("name", sorted(FLOODS))
def test_a_small_flood_is_refused_by_a_budget_of_four_times_the_file(tmp_path, monkeypatch, name):
    """20 000 of each (a file of 20 to 100 KB), without the allowance every load has: refused,
    naming what the pickle made, before it ran to its end."""
    monkeypatch.setattr(records, "LOAD_ALLOWANCE", 0)
    body, _, says = FLOODS[name]
    path = in_zip(tmp_path / f"{name}.pth", program(body(20_000)))
    with pytest.raises(CheckpointError, match=f"the pickle's {says}: {BOUND}"):
        read_checkpoint(path)


def test_a_flood_in_a_legacy_file_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "LOAD_ALLOWANCE", 0)
    path = legacy(tmp_path / "sets.pth", program(FLOODS["empty-sets"][0](20_000)))
    with pytest.raises(CheckpointError, match=f"the pickle's sets \\(EMPTY_SET\\): {BOUND}"):
        read_checkpoint(path)


def test_the_unpickler_takes_from_the_budget_materialize_spends():
    """What a pickle's objects cost is taken from the load in progress (records.load_left, what
    records.spend takes from), and what was not made is left to it."""
    with load_budget(0):
        before = records.load_left()[0]
        got = InertUnpickler(io.BytesIO(program(_into_a_list(pickle.EMPTY_SET * 1000)))).load()
        spent = before - records.load_left()[0]
        assert len(got) == 1000
        # (at least the sets; the block the loop took and did not use given back)
        assert 1000 * sys.getsizeof(set()) <= spent < 1000 * sys.getsizeof(set()) + (1 << 16), spent
        records.spend(records.load_left()[0], "the rest")  # (all that is left, and not a byte more)
        with pytest.raises(RefusedError, match="the pickle's sets"):
            InertUnpickler(io.BytesIO(program(pickle.EMPTY_SET))).load()


def test_the_unpickler_used_outside_a_load_has_a_budget_of_its_own():
    """Outside read_torch_checkpoint (no load_budget), InertUnpickler bounds itself by what is
    left of its input."""
    assert records.load_left() is None
    with pytest.raises(RefusedError, match=f"the pickle's sets \\(EMPTY_SET\\): {BOUND}"):
        InertUnpickler(io.BytesIO(program(FLOODS["empty-sets"][0](200_000)))).load()
    assert records.load_left() is None
    assert len(InertUnpickler(io.BytesIO(program(FLOODS["empty-sets"][0](1000)))).load()) == 1000


def test_a_runner_checkpoint_loads_within_four_times_its_size(tmp_path, monkeypatch):
    """A Runner's checkpoint of a Swin-B-deep backbone of narrow width (its pickle a large part of
    the file): weights, AdamW state, mmengine's message hub, meta. What its pickle makes fits 4
    times the file's size, without the allowance."""
    pytest.importorskip("mmengine")
    from mmengine.logging import MessageHub

    from swin_backbone import SwinBackbone

    model = SwinBackbone(arch=None, embed_dims=8, depths=(2, 2, 18, 2), num_heads=(1, 1, 1, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3, 64, 64))[-1].sum().backward()
    optimizer.step()
    hub = MessageHub(f"floods-{os.getpid()}")
    for step in range(1000):
        for name in ("train/loss", "train/lr", "train/time", "train/data_time"):
            hub.update_scalar(name, float(step))
    hub.update_info("iter", 1000)
    runner = dict(meta=dict(epoch=1, iter=1000, dataset_meta=dict(classes=[f"class{k}" for k in range(80)],
                                                                  palette=[(k, k, k) for k in range(80)])),
                  state_dict=model.state_dict(), optimizer=optimizer.state_dict(), message_hub=hub.state_dict())
    torch.save(runner, tmp_path / "runner.pth")
    monkeypatch.setattr(records, "LOAD_ALLOWANCE", 0)
    got = read_checkpoint(str(tmp_path / "runner.pth"))
    assert got["state_dict"].keys() == runner["state_dict"].keys()
    assert len(got["optimizer"]["state"]) == len(runner["optimizer"]["state"]) > 300
    assert got["message_hub"]["log_scalars"]["train/loss"].current() == 999.0
    assert got["message_hub"]["runtime_info"]["iter"] == 1000


def test_a_file_of_many_small_tensors_loads_within_the_allowance(tmp_path):
    """5000 scalar tensors (1.5 MB): each is charged about 3 KB of objects for its 300 bytes of
    file; the allowance every load has holds them."""
    scalars = {f"layers.{k}.num_batches_tracked": torch.tensor(k) for k in range(5000)}
    torch.save(scalars, tmp_path / "scalars.pth")
    got = read_checkpoint(str(tmp_path / "scalars.pth"))
    assert len(got) == 5000 and got["layers.4999.num_batches_tracked"] == 4999


#: Floods of stack slots only (8 bytes an opcode): MAX_OPCODES of them (32 MB) fit the budget of
#: the 4 MB file that holds them (they load, with or without the charge; refused above at small
#: size, without the allowance).
WITHIN_THE_BOUND = {"empty-tuples-on-the-stack", "dups"}

_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    from swin_backbone.checkpoint import CheckpointError, read_checkpoint
    try:
        with open("/proc/self/clear_refs", "w") as f:  # (Linux: the peak so far forgotten, the imports')
            f.write("5")
    except OSError:
        pass
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        read_checkpoint(sys.argv[1])
        out = "loaded"
    except CheckpointError as err:
        out = "refused: " + str(err)
    print(json.dumps(dict(out=out, maxrss_mb=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)))
""")


@pytest.mark.slow  # the payload runs in a subprocess
@pytest.mark.parametrize("name", sorted(set(FLOODS) - WITHIN_THE_BOUND))
def test_a_flood_of_a_few_mb_is_refused_in_a_subprocess_that_stays_small(tmp_path, name):
    """Each flood at full size (a file of 4 to 10 MB, under MAX_OPCODES): refused with the budget's
    message, the process grown by less than 100 MB by the load (before: more for 10 of the 12, up to
    1 GB)."""
    body, n, says = FLOODS[name]
    path = in_zip(tmp_path / f"{name}.pth", program(body(n)))
    assert os.path.getsize(path) < 12 << 20
    done = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "refused, nothing in it ran: the pickle's" in out["out"], out
    assert re.search(f"the pickle's {says}: {BOUND}", out["out"]), out
    assert out["maxrss_mb"] < 100, out
