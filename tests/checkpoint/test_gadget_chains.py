"""Gadget chains built from the table's own rows (records.py), as the review's attacker built them:
each row called, created and given state with hostile arguments; chains of two or three rows
through torch's rebuild functions; payloads that could crash run in a subprocess and end in a
CheckpointError, never a signal; process-wide state unchanged; a bounded fuzz in a subprocess
that composes rows with calls shaped to the stack and mutates real mmengine checkpoints.
Runs on every stack (Makefile COMPAT_CORE)."""
from __future__ import annotations

import collections
import inspect
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch

from swin_backbone.checkpoint import CheckpointError, read_checkpoint
from swin_backbone.checkpoint import records
from swin_backbone.checkpoint.records import RefusedError, materialize
from swin_backbone.checkpoint.unpickler import InertUnpickler

from .pickles import (FALSE, NONE, TRUE, b, build, call, d, g, get, i, in_zip, l, legacy, new, np_array, np_dtype,
                      program, put, s, t, tensor, twin_zip)

HB = "mmengine.logging.history_buffer.HistoryBuffer"
CD = "mmengine.config.config.ConfigDict"
R2 = "torch._tensor._rebuild_from_type_v2"


def _read(body: bytes):
    """A pickle without storages, through the unpickler and materialize."""
    return materialize(InertUnpickler(io.BytesIO(program(body))).load())


def _history_state(log=None, count=None, extra=()):
    f8, i8 = np_dtype("f8"), np_dtype("i8")
    return d((s("max_length"), i(10)), (s("_log_history"), log or np_array((1,), f8, b(b"\0" * 8))),
             (s("_count_history"), count or np_array((1,), i8, b(b"\1" + b"\0" * 7))), *extra)


#: name -> (pickle body, what the refusal says). Every one is refused before anything is made of it.
CHAINS = {
    # the review's chain, step by step
    "configdict-array-interface": (call(g(CD), d((s("__array_interface__"), d((s("data"), t(i(4096), FALSE)))))),
                                   "names an attribute protocol"),
    "historybuffer-called-with-configdicts": (call(g(HB), call(g(CD), d()), call(g(CD), d())),
                                              "calls the global " + HB),
    "getattr-mean-called-by-rebuild_from_type_v2": (
        call(g(R2), call(g("builtins.getattr"), g(HB), s("mean")), g("torch.Tensor"), t(i(1), i(2)), d()),
        "calls only torch's tensor rebuilds"),
    "rebuild_from_type_v2-calls-a-class": (call(g(R2), g(HB), g("torch.Tensor"), t(), d()),
                                           "calls only torch's tensor rebuilds"),
    "rebuild_from_type_v2-calls-itself": (call(g(R2), g(R2), g("torch.Tensor"), t(), d()),
                                          "calls only torch's tensor rebuilds"),
    "rebuild_from_type_v2-makes-a-historybuffer": (call(g(R2), g("torch._utils._rebuild_parameter"), g(HB), t(), d()),
                                                   "makes only tensors and parameters"),
    "dtype-object-without-hasobject": (np_dtype("O8", t(i(3), s("|"), NONE, NONE, NONE, i(-1), i(-1), i(0x3E))),
                                       "object, string, void and datetime dtypes are refused"),
    "dtype-f8-forged-flags": (np_dtype("f8", t(i(3), s("<"), NONE, NONE, NONE, i(-1), i(-1), i(0x3E))),
                              "its state must be numpy's own"),
    "dtype-built-twice": (build(np_dtype("f8"), t(i(3), s("<"), NONE, NONE, NONE, i(-1), i(-1), i(0))),
                          "its state must be numpy's own"),
    "scalar-of-dtype-S": (call(g("numpy._core.multiarray.scalar"), np_dtype("S"), b(b"abcdef")),
                          "object, string, void and datetime dtypes are refused"),
    "scalar-of-dtype-U": (call(g("numpy.core.multiarray.scalar"), np_dtype("U"), b(b"abcd")),
                          "object, string, void and datetime dtypes are refused"),
    "scalar-short-bytes": (call(g("numpy._core.multiarray.scalar"), np_dtype("f8"), b(b"\0")), "expected 8 bytes"),
    "ndarray-called": (call(g("numpy.ndarray"), t(i(2 ** 28)), np_dtype("f8")), "calls the global numpy.ndarray"),
    "array-of-2**28-from-8-bytes": (np_array((2 ** 28,), np_dtype("f8"), b(b"\0" * 8)), "needs 2147483648 bytes"),
    "array-data-a-configdict": (np_array((1,), np_dtype("f8"), call(g(CD), d((s("__array_interface__"), i(0))))),
                                "its data must be bytes, found a ConfigDict"),
    "array-data-a-list": (np_array((1,), np_dtype("f8"), l(i(0))), "its data must be bytes"),
    "reconstruct-other-subtype": (call(g("numpy._core.multiarray._reconstruct"), g(HB), t(i(0)), b(b"b")),
                                  "expected (numpy.ndarray, (0,), b'b')"),
    "defaultdict-none-of-an-array": (call(g("collections.defaultdict"), NONE, np_array((0,), np_dtype("f8"), b(b""))),
                                     "expected a dict of items"),
    "defaultdict-factory-getattr": (call(g("collections.defaultdict"), g("builtins.getattr")),
                                    "its factory must be None"),
    "historybuffer-setstate-key": (build(new(g(HB)), _history_state(extra=[(s("__setstate__"), s("exec"))])),
                                   "expected its state"),
    "historybuffer-statistics-methods-int": (
        build(new(g(HB)), _history_state(extra=[(s("statistics_methods"), d((s("mean"), i(0))))])),
        "statistics_methods: expected"),
    "historybuffer-built-twice": (build(build(new(g(HB)), _history_state()), _history_state()), "expected its state"),
    "historybuffer-history-a-configdict": (build(new(g(HB)), _history_state(log=call(g(CD), d()))),
                                           "expected a 1-D numpy array"),
    "historybuffer-newobj-args": (new(g(HB), i(1)), "expected no arguments"),
    "build-on-an-entry": (build(g(HB), d((s("statistics_methods"), d()))), "the global " + HB),
    "build-on-a-dict": (build(d(), d((s("__class__"), i(1)))), "set the state of a dict"),
    "build-ordereddict-keys": (build(call(g("collections.OrderedDict")), d((s("keys"), i(1)))),
                               "set the state of a collections.OrderedDict"),
    "build-ordereddict-metadata-entry": (build(call(g("collections.OrderedDict")), d((s("_metadata"), g(HB)))),
                                         "expected a dict of module versions"),
    "getattr-init": (call(g("builtins.getattr"), g(HB), s("__init__")), "builtins.getattr(the global"),
    "getattr-with-default": (call(g("builtins.getattr"), g(HB), s("min"), NONE), "builtins.getattr(the global"),
    "getattr-on-getattr": (call(g("__builtin__.getattr"), g("__builtin__.getattr"), s("__self__")),
                           "builtins.getattr(the global builtins.getattr, '__self__')"),
    "messagehub-scalars-configdict": (
        build(new(g("mmengine.logging.message_hub.MessageHub")), d((s("_log_scalars"), d((s("x"), call(g(CD), d())))))),
        "MessageHub _log_scalars"),
    "setitem-into-configdict": (call(g(CD), d()) + s("k") + i(1) + pickle.SETITEM, "SETITEM into a ConfigDict"),
    "append-into-a-tuple": (t() + i(1) + pickle.APPEND, "APPEND into a tuple"),
    "counter-of-strings": (call(g("collections.Counter"), d((s("a"), s("b")))), "a dict of counts"),
    "set-of-a-record": (call(g("builtins.set"), l(call(g(CD), d()))), "a dict key or set item"),
    "entry-left-in-the-data": (d((s("x"), g("numpy.ndarray"))), "the global numpy.ndarray, which is not data"),
    "class-left-in-the-data": (d((s("x"), g("torch.UntypedStorage"))), "which is not data"),
    "cycle": (pickle.EMPTY_LIST + put(0) + get(0) + pickle.APPEND, "refers to itself"),
    "deep": (pickle.EMPTY_LIST * 100 + pickle.APPEND * 99, "deeper than"),
    # 20 levels built once, then hung 20 levels down: each part is shallow, the whole is 40 deep
    "deep-through-sharing": (pickle.EMPTY_LIST * 20 + pickle.APPEND * 19 + put(0) + pickle.POP
                             + pickle.EMPTY_LIST * 20 + get(0) + pickle.APPEND * 20, "deeper than"),
    # a DAG of 2**40 paths: [x, x] nested 40 deep, inside a ConfigDict (checked at construction)
    "exponential-dag": (call(g(CD), d((s("k"), l(i(0)) + b"".join(put(1) + pickle.POP + l(get(1), get(1))
                                                                    for _ in range(40))))),
                        "deeper than"),
    "inst-opcode": (b"(ios\nsystem\nS'true'\n" + b"", "INST"),
    "obj-opcode": (pickle.MARK + g("collections.OrderedDict") + pickle.OBJ, "OBJ"),
    "ext1-opcode": (pickle.EXT1 + b"\x01", "EXT1"),
    "text-persid": (pickle.PERSID + b"0\n", "PERSID"),
    "binpersid-outside-torch": (t(s("storage")) + pickle.BINPERSID, "outside a torch checkpoint"),
    "size-of-a-record": (call(g("torch.Size"), t(call(g(CD), d()))), "expected an int"),
    "device-with-code": (call(g("torch.device"), s("cuda;import os")), "torch.device"),
    "parameter-of-a-configdict": (call(g("torch._utils._rebuild_parameter"), call(g(CD), d()), TRUE, NONE),
                                  "expected a tensor"),
    # checked, then changed: the dict a ConfigDict's REDUCE checked, filled afterwards through the memo
    "configdict-filled-after-its-reduce": (
        d() + put(0) + pickle.POP + call(g(CD), get(0)) + put(1) + pickle.POP
        + get(0) + s("__array_interface__") + d((s("data"), t(i(4096), FALSE))) + pickle.SETITEM + pickle.POP + get(1),
        "names an attribute protocol"),
    # keys that would hash with no bound on recursion, or all to one value (quadratic inserts)
    "key-a-nested-tuple": (d() + t(t(i(1))) + NONE + pickle.SETITEM, "a dict key or set item"),
    "key-in-a-dict-opcode": (pickle.MARK + t(t(i(1))) + NONE + pickle.DICT, "DICT: a dict key"),
    "item-of-a-frozenset-opcode": (pickle.MARK + t(t(i(1))) + pickle.FROZENSET, "FROZENSET: a dict key"),
    "key-of-an-ordereddict-pair": (call(g("collections.OrderedDict"), l(t(t(t(i(1))), NONE))), "a dict key"),
    "keys-sharing-one-hash": (d(*[(i(k * (2 ** 61 - 1)), NONE) for k in (1, 2, 3)]), "an int within 2**61"),
    # parts that hash as one another, multiplied by a tuple (-1 and -2; True and 1)
    "tuple-keys-of-minus-one-and-two": (d((t(i(-1), i(-2)), NONE), (t(i(-2), i(-1)), NONE)), "a dict key"),
    "tuple-key-of-a-bool": (d((t(TRUE, i(1)), NONE)), "a dict key"),
    "tuple-key-too-long": (d((t(*[i(0)] * 9), NONE)), "a dict key"),
    "key-too-long": (d((s("k" * 5000), NONE)), "a dict key"),
    # text memo indices are any int: k * (2**61 - 1) all share a hash
    "text-put": (NONE + b"p2305843009213693951\n", "(PUT) is not read"),
    "text-get": (b"g1\n", "(GET) is not read"),
    "size-of-a-huge-int": (np_array((2 ** 80,) * 2, np_dtype("f8"), b(b"")), "expected an int in [0, "),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_a_chain_of_the_tables_rows_is_refused(name):
    body, says = CHAINS[name]
    with pytest.raises(RefusedError) as info:
        _read(body)
    assert says in str(info.value), str(info.value)


@pytest.mark.parametrize("data", [b"", b"\x80\x02", program(b"")[:-1] + pickle.EMPTY_DICT])
def test_an_empty_or_cut_off_pickle_is_refused_as_malformed(data):
    with pytest.raises(RefusedError, match="a malformed pickle .*EOFError"):
        InertUnpickler(io.BytesIO(data)).load()


#: Payloads with storages (the archive's record ``0`` holds 4 float32): name -> (data.pkl body, says).
STORAGE_CHAINS = {
    "storage-larger-than-its-record": (tensor(numel=2 ** 30, size=(2 ** 30,)), "has 16"),
    "storage-missing-record": (tensor(key="7"), "has none"),
    "storage-key-a-path": (tensor(key="../../etc/passwd"), "expected a short name"),
    "storage-location-code": (t(s("storage"), g("torch.FloatStorage"), s("0"), s("cuda:0;x"), i(4)) + pickle.BINPERSID,
                              "expected a device"),
    "storage-typename-module": (t(s("module"), g("torch.FloatStorage"), s("0"), s("cpu"), i(4)) + pickle.BINPERSID,
                                "only storages of the file"),
    "tensor-past-its-storage": (tensor(offset=3, size=(4,)), "reaches past its storage"),
    "tensor-huge-view-of-one-element": (tensor(size=(2 ** 40,), stride=(0,)), "elements over a storage of 4"),
    "tensor-backward-hooks": (call(g("torch._utils._rebuild_tensor_v2"), t(s("storage"), g("torch.FloatStorage"), s("0"),
                                                                         s("cpu"), i(4)) + pickle.BINPERSID,
                                   i(0), t(i(4)), t(i(1)), FALSE, d((i(0), s("exec")))),
                              "backward hooks"),
    "build-on-a-tensor": (build(tensor(), t(i(0))), "set the state of a torch.Tensor"),
    "rebuild_from_type_v2-with-state": (call(g(R2), g("torch._utils._rebuild_tensor_v2"), g("torch.Tensor"),
                                             t(t(s("storage"), g("torch.FloatStorage"), s("0"), s("cpu"), i(4))
                                               + pickle.BINPERSID, i(0), t(i(4)), t(i(1)), FALSE, NONE),
                                             d((s("__class__"), g(HB)))),
                                        "only flags"),
    "tensor-state-shadows-data": (call(g(R2), g("torch._utils._rebuild_tensor_v2"), g("torch.Tensor"),
                                       t(t(s("storage"), g("torch.FloatStorage"), s("0"), s("cpu"), i(4))
                                         + pickle.BINPERSID, i(0), t(i(4)), t(i(1)), FALSE, NONE),
                                       d((s("grad"), NONE))),
                                  "only flags"),
}


@pytest.mark.parametrize("name", sorted(STORAGE_CHAINS))
def test_a_chain_through_torchs_storages_is_refused(tmp_path, name):
    body, says = STORAGE_CHAINS[name]
    path = in_zip(tmp_path / "evil.pth", program(d((s("state_dict"), d((s("w"), body))))))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    assert says in str(info.value) and path in str(info.value), str(info.value)


def test_the_forms_real_files_use_are_read(tmp_path):
    """The rows' honest forms, written the same way: a control that the refusals above are the
    rows' checks, not a broken writer."""
    f8 = np_dtype("f8")
    got = _read(d((s("a"), np_array((2,), f8, b(np.array([1.5, 2.5]).tobytes()))),
                  (s("s"), call(g("numpy._core.multiarray.scalar"), np_dtype("i8"), b((7).to_bytes(8, "little")))),
                  (s("h"), build(new(g(HB)), _history_state())),
                  (s("c"), call(g(CD), d((s("k"), l(i(1), i(2)))))),
                  (s("n"), call(g("collections.Counter"), d((i(1), i(1))))),
                  (s("f"), call(g("builtins.frozenset"), l(i(1)))),
                  (s("z"), call(g("torch.Size"), t(i(2), i(3))))))
    np.testing.assert_array_equal(got["a"], [1.5, 2.5])
    assert got["s"] == 7 and type(got["s"]) is np.int64
    assert type(got["h"]).__name__ == "HistoryBuffer" and got["h"].max_length == 10
    assert got["c"].k == [1, 2] and got["n"] == {1: 1} and got["f"] == frozenset({1}) and got["z"] == (2, 3)
    path = in_zip(tmp_path / "ok.pth", program(d((s("state_dict"), d((s("w"), tensor(offset=1, size=(3,))))))))
    torch.testing.assert_close(read_checkpoint(path)["state_dict"]["w"], torch.ones(3))


def test_a_state_dicts_metadata_keeps_module_versions_only(tmp_path):
    """``_metadata`` as torch writes it, ``{prefix: {'version': int}}``, whatever the file fills
    into it after its BUILD (through the memo): no class, record or ``load_state_dict`` switch
    (``assign_to_params_buffers`` would make mmengine's load adopt the file's tensors, strides
    and aliasing included, as parameters)."""
    metadata = (d() + put(0) + pickle.POP + build(call(g("collections.OrderedDict")), d((s("_metadata"), get(0))))
                + put(1) + pickle.POP + get(0) + s("") + d((s("version"), i(2)), (s("assign_to_params_buffers"), TRUE))
                + pickle.SETITEM + s("fc") + d((s("version"), g("torch.UntypedStorage"))) + pickle.SETITEM + pickle.POP)
    path = in_zip(tmp_path / "metadata.pth", program(metadata + get(1) + s("weight") + tensor(size=(1, 4), stride=(4, 1))
                                                     + pickle.SETITEM))
    got = read_checkpoint(path)
    assert dict(got._metadata) == {"": {"version": 2}, "fc": {}}
    model = torch.nn.Linear(4, 1, bias=False)
    weight = model.weight
    from mmengine.runner import load_checkpoint as mmengine_load_checkpoint

    mmengine_load_checkpoint(model, path, map_location="cpu")  # (through the package's reader)
    assert model.weight is weight and model.weight.dtype == torch.float32  # copied into, not assigned
    if "assign" in inspect.signature(torch.nn.Module.load_state_dict).parameters:  # (torch >= 2.1)
        # the control: torch itself honours the switch
        sd = collections.OrderedDict(weight=torch.zeros(1, 4, dtype=torch.float64))
        sd._metadata = {"": {"assign_to_params_buffers": True}}
        model.load_state_dict(sd)
        assert model.weight.dtype == torch.float64


def test_a_counter_is_read_as_its_counts():
    got = _read(call(g("collections.Counter"), d((s("a"), i(2)), (s("b"), i(1)))))
    assert got == {"a": 2, "b": 1} and type(got).__name__ == "Counter"


def test_an_fsdp_shard_rebuilds_only_sharded_tensors(tmp_path):
    """The shard loads' own classes (swin_backbone.mmlab.fsdp.sharded_classes): torch's
    ``_rebuild_from_type_v2`` calls whatever the stack holds; a shard's only calls its wrapper
    rebuild of a ShardedTensor (an uninitialised storage of any size was made otherwise)."""
    pytest.importorskip("mmengine")
    from swin_backbone.checkpoint.files import read_torch_file
    from swin_backbone.mmlab.fsdp import sharded_classes

    untyped = call(g(R2), g("torch.UntypedStorage"), g("torch.UntypedStorage"), t(i(1 << 20)), d())
    wrapper = call(g(R2), g("torch._utils._rebuild_wrapper_subclass"),
                   g("torch.distributed._shard.sharded_tensor.api.ShardedTensor"),
                   t(g("torch.Tensor"), g("torch.float32"), t(i(4)), t(i(1)), i(0), NONE, NONE, FALSE), d())
    deep = pickle.EMPTY_TUPLE + pickle.TUPLE1 * 10 ** 5
    meta = "torch.distributed._shard.sharded_tensor.metadata."
    enum_state = (call(g(meta + "MEM_FORMAT_ENCODING"), i(0)) + d((s("_value_"), s("pwned"))) + pickle.BUILD)
    for name, body, says in (("untyped", untyped, "calls only torch's tensor rebuilds"),
                             ("wrapper", wrapper, r"a ShardedTensor's state: expected \(shards, metadata"),
                             ("layout", call(g("torch.serialization._get_layout"), deep), "expected one of torch.strided"),
                             ("enum", call(g(meta + "MEM_FORMAT_ENCODING"), deep), "only an Enum with one of its"),
                             ("enum-state", enum_state, "set the state of"),
                             ("new-with-arguments", new(g(meta + "TensorProperties"), i(1)), "expected no arguments"),
                             ("state-of-a-class", build(new(g(meta + "TensorProperties")),
                                                        d((s("dtype"), g("torch.UntypedStorage")))),
                              "expected data of the load's own classes")):
        path = in_zip(tmp_path / f"{name}.pth", program(d((s("x"), body))))
        with pytest.raises(CheckpointError, match=says):
            read_torch_file(path, "torch-zip", trusted=sharded_classes())
    from swin_backbone.mmlab.fsdp import _rebuild_sharded_wrapper

    with pytest.raises(CheckpointError, match="makes only a ShardedTensor"):  # (a shard's state checked, its class)
        _rebuild_sharded_wrapper(torch.Tensor, torch.float32, (4,), (1,), 0, None, None, False)
    # a plain tensor in a shard still reads through the table's rows
    path = in_zip(tmp_path / "plain.pth", program(d((s("x"), tensor()))))
    torch.testing.assert_close(read_torch_file(path, "torch-zip", trusted=sharded_classes())["x"], torch.ones(4))


# ---------------------------------------------------------------- every row
#: Arguments an attacker hands a row: plain values, dunder dicts, rows themselves, records.
HOSTILE_ARGS = [(), (NONE,), (s("x"),), (i(1),), (b(b"b"),), (t(i(0)),), (l(i(1)),),
                (d((s("__class__"), i(1))),), (d((s("__array_interface__"), d())),), (g(HB),), (g("builtins.getattr"),),
                (call(g(CD), d()),), (np_dtype("f8"),), (g("numpy.ndarray"), t(i(0)), b(b"b")),
                (s("__self__"), s("exec")), (g(HB), s("mean")), (NONE, d((s("x"), i(1)))), (i(2 ** 40), i(-1))]


def _callables(value, depth=0):
    """Callables anywhere in ``value`` (classes and functions; never a tensor or an array)."""
    if depth > 40:
        return []
    if isinstance(value, dict):
        found = [v for v in [getattr(value, "default_factory", None)] if v is not None]
        return found + [c for k, v in value.items() for c in _callables(k, depth + 1) + _callables(v, depth + 1)]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [c for v in value for c in _callables(v, depth + 1)]
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return []
    if type(value).__name__ in ("HistoryBuffer", "ConfigDict"):
        return _callables(vars(value), depth + 1) if type(value).__name__ == "ConfigDict" else []
    return [value] if callable(value) else []


@pytest.mark.parametrize("row", sorted(records.ENTRIES))
def test_no_row_returns_or_stores_a_callable(row):
    """Each row, called (REDUCE), created (NEWOBJ) and then given a dunder state (BUILD) with each
    of :data:`HOSTILE_ARGS`: refused, or data without a callable in it."""
    outcomes = {"refused": 0, "data": 0}
    for args in HOSTILE_ARGS:
        for body in (call(g(row), *args), new(g(row), *args),
                     build(call(g(row), *args), d((s("__setstate__"), g("builtins.getattr")))),
                     build(new(g(row), *args), d((s("__dict__"), d((s("x"), i(1))))))):
            try:
                value = _read(d((s("v"), body)))
            except RefusedError:
                outcomes["refused"] += 1
                continue
            outcomes["data"] += 1
            assert not _callables(value), (row, args, value)
    assert outcomes["refused"] > 0, outcomes


# ---------------------------------------------------------------- process-wide state
def _process_state():
    from mmengine.logging import HistoryBuffer
    from mmengine.runner.checkpoint import CheckpointLoader

    return dict(statistics={k: v for k, v in HistoryBuffer._statistics_methods.items()},
                numpy_s=np.array([b"abcdef"], dtype="S").tolist(), numpy_u=np.array(["abcdef"], dtype="U").tolist(),
                safe_globals=list(torch.serialization.get_safe_globals()) if hasattr(torch.serialization,
                                                                                  "get_safe_globals") else None,
                schemes=dict(CheckpointLoader._schemes), entries={k: (v, v.name) for k, v in records.ENTRIES.items()},
                constants=dict(records.CONSTANTS))


def test_no_chain_changes_process_wide_state(tmp_path):
    before = _process_state()
    for body, _ in CHAINS.values():
        with pytest.raises(RefusedError):
            _read(body)
    for n, (body, _) in enumerate(STORAGE_CHAINS.values()):
        with pytest.raises(CheckpointError):
            read_checkpoint(in_zip(tmp_path / f"{n}.pth", program(body)))
    assert _process_state() == before


@pytest.mark.slow  # the payload runs in a subprocess
def test_import_changes_nothing_torch_accepts():
    """``get_safe_globals()`` with and without ``import swin_backbone`` (the libraries it imports
    imported in both: torch adds some of its own lazily), and torch.load of a file that names
    a table row still refused by torch alone."""
    if not hasattr(torch.serialization, "get_safe_globals"):
        pytest.skip(f"torch {torch.__version__} has no process-wide weights-only list to change")
    script = textwrap.dedent("""
        import sys, torch
        import mmengine.runner, mmengine.logging, mmengine.config  # what the package imports of mmengine
        for name in ("mmdet.models", "mmseg.models"):
            try:
                __import__(name)
            except ImportError:
                pass
        if sys.argv[1] == "with":
            import swin_backbone
        named = [g if isinstance(g, tuple) else (g, "") for g in torch.serialization.get_safe_globals()]
        print("LIST", sorted(f"{getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', type(o).__name__)} {n}"
                             for o, n in named))
    """)
    lists = [subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, check=True
                            ).stdout.split("LIST", 1)[1] for arg in ("without", "with")]
    assert lists[0] == lists[1] and lists[0].strip()


# ---------------------------------------------------------------- crashes and memory: in a subprocess
_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    from swin_backbone.checkpoint import CheckpointError, read_checkpoint
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {}
    for path in sys.argv[1:]:
        try:
            read_checkpoint(path)
            out[os.path.basename(path)] = "loaded"
        except CheckpointError as err:
            out[os.path.basename(path)] = "refused: " + str(err)
    out["maxrss_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # above the imports' peak
    print(json.dumps(out))
""")


@pytest.mark.slow  # the payload runs in a subprocess
def test_crashing_payloads_end_in_a_checkpoint_error_in_a_subprocess(tmp_path):
    """What segfaulted, corrupted numpy or allocated 3.2 GB under the allow-list: each file is
    refused, the process ends normally and stays under 1 GB."""
    big = 2 ** 28
    files = {
        "pointer-read.pth": in_zip(tmp_path / "pointer-read.pth", program(
            call(g(HB), call(g(CD), d((s("__array_interface__"), d((s("data"), t(i(0x41414141000), FALSE)),
                                                                    (s("shape"), t(i(8))), (s("typestr"), s("|u1")))))))
        )),
        "forged-object.pth": in_zip(tmp_path / "forged-object.pth", program(
            np_array((1,), np_dtype("O8", t(i(3), s("|"), NONE, NONE, NONE, i(-1), i(-1), i(0x3E))),
                     b(b"AAAAAAAA")))),
        "object-array-2-28.pth": in_zip(tmp_path / "object-array-2-28.pth", program(
            call(g("numpy.ndarray"), t(i(big)), np_dtype("O8")))),
        "float-array-2-28.pth": in_zip(tmp_path / "float-array-2-28.pth", program(
            np_array((big,), np_dtype("f8"), b(b"\0" * 8)))),
        "zip-storage-2-40.pth": in_zip(tmp_path / "zip-storage-2-40.pth", program(
            tensor(numel=2 ** 40, size=(2 ** 40,)))),
        "legacy-storage-2-40.pth": legacy(tmp_path / "legacy-storage-2-40.pth", program(
            call(g("torch._utils._rebuild_tensor_v2"),
                 t(s("storage"), g("torch.FloatStorage"), s("0"), s("cpu"), i(2 ** 40), NONE) + pickle.BINPERSID,
                 i(0), t(i(2 ** 40)), t(i(1)), FALSE, call(g("collections.OrderedDict"))))),
        "legacy-bytes-2-40.pth": legacy(tmp_path / "legacy-bytes-2-40.pth",
                                        program(pickle.BINBYTES8 + (2 ** 40).to_bytes(8, "little") + b"x")),
        "bytearray-2-34.pth": in_zip(tmp_path / "bytearray-2-34.pth", program(pickle.BYTEARRAY8
                                                                           + (2 ** 34).to_bytes(8, "little"))),
        "scalar-S.pth": in_zip(tmp_path / "scalar-S.pth", program(
            call(g("numpy._core.multiarray.scalar"), np_dtype("S"), b(b"abcdef")))),
        # a million nested tuples as a key (CPython's tuple hash recurses with no limit: SIGSEGV)
        "deep-tuple-key.pth": in_zip(tmp_path / "deep-tuple-key.pth", program(
            pickle.EMPTY_DICT + pickle.EMPTY_TUPLE + pickle.TUPLE1 * 10 ** 6 + TRUE + pickle.SETITEM)),
        "deep-tuple-frozenset.pth": in_zip(tmp_path / "deep-tuple-frozenset.pth", program(
            pickle.MARK + pickle.EMPTY_TUPLE + pickle.TUPLE1 * 10 ** 6 + pickle.FROZENSET)),
        # 1 MB copied 1500 times by _codecs.encode (1.5 GB), and 1 MB shared by 1500 numpy arrays
        "encode-amplified.pth": in_zip(tmp_path / "encode-amplified.pth", program(
            g("_codecs.encode") + put(0) + s("A" * 2 ** 20) + s("latin1") + pickle.TUPLE2 + put(1) + pickle.POP
            + pickle.POP + pickle.MARK + (get(0) + get(1) + pickle.REDUCE) * 1500 + pickle.LIST)),
        # one history shared by 1500 HistoryBuffers (each copies it), one tensor named 1500 times
        "histories-amplified.pth": in_zip(tmp_path / "histories-amplified.pth", program(
            b(b"\0" * 2 ** 20) + put(2) + pickle.POP + np_dtype("f8") + put(3) + pickle.POP
            + np_array((2 ** 17,), get(3), get(2)) + put(4) + pickle.POP + pickle.MARK
            + build(new(g(HB)), _history_state(log=get(4), count=get(4))) * 1500 + pickle.LIST)),
        "tensor-named-many-times.pth": in_zip(tmp_path / "tensor-named-many-times.pth", program(
            tensor(numel=2 ** 16, size=(2 ** 16,)) + put(5) + pickle.POP + pickle.MARK + get(5) * 1500
            + pickle.LIST), torch.ones(2 ** 16)),
        "arrays-amplified.pth": in_zip(tmp_path / "arrays-amplified.pth", program(
            b(b"\0" * 2 ** 20) + put(2) + pickle.POP + np_dtype("f8") + put(3) + pickle.POP + pickle.MARK
            + np_array((2 ** 17,), get(3), get(2)) * 1500 + pickle.LIST)),
    }
    assert os.path.getsize(files["object-array-2-28.pth"]) < 4096
    done = subprocess.run([sys.executable, "-c", _CHILD, *files.values()], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # never a signal (-11)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name in files:
        assert out[name].startswith("refused: "), (name, out[name])
        assert "nothing in it ran" in out[name] or "cannot be read" in out[name], out[name]
    assert out["maxrss_mb"] < 1024, out["maxrss_mb"]


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_zip_bomb_is_refused_without_decompressing_it(tmp_path):
    """The review's file: a checkpoint beside a deflated 600 MB record (588 KB on disk). Refused
    from the central directory alone, in a subprocess that stays small."""
    import zipfile

    path = in_zip(tmp_path / "bomb.pth", program(d((s("w"), tensor()))))
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as z:
        with z.open("bomb/extra.pkl", "w") as f:
            chunk = b"\0" * (1 << 20)
            for _ in range(600):
                f.write(chunk)
    assert os.path.getsize(path) < 2 * 2 ** 20
    done = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "is compressed" in out["bomb.pth"] and out["maxrss_mb"] < 200, out


# ---------------------------------------------------------------- the independent review's attacks
_SCRIPTED = textwrap.dedent("""
    import sys, torch
    from typing import Tuple

    class Writes(torch.nn.Module):  # its TorchScript __setstate__ creates and writes a file
        def __init__(self, path: str):
            super().__init__()
            self.path = path
            self.payload = torch.tensor(list(b"pwned"), dtype=torch.uint8)

        def forward(self, x):
            return x

        @torch.jit.export
        def __getstate__(self) -> Tuple[str, torch.Tensor]:
            return (self.path, self.payload)

        @torch.jit.export
        def __setstate__(self, state: Tuple[str, torch.Tensor]):
            self.training = False
            self.path = state[0]
            f = torch.from_file(state[0], True, state[1].numel(), dtype=torch.uint8)
            f.copy_(state[1])
            self.payload = f

    torch.jit.save(torch.jit.script(Writes(sys.argv[1])), sys.argv[2])
""")


def _members(path):
    import zipfile

    with zipfile.ZipFile(path) as z:
        return [(info.filename, z.read(info.filename)) for info in z.infolist()]


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_torchscript_archive_is_refused_however_its_directory_reads(tmp_path):
    """A TorchScript module whose ``__setstate__`` writes a file: as it is, and hidden behind a
    second central directory that Python's zipfile reads as a plain checkpoint while torch's
    reader sees TorchScript (torch.load would hand it to torch.jit.load). Never written."""
    marker = tmp_path / "written"
    scripted = tmp_path / "scripted.pt"
    script = tmp_path / "make_scripted.py"  # (torch.jit.script reads the class's source from a file)
    script.write_text(_SCRIPTED)
    subprocess.run([sys.executable, str(script), str(marker), str(scripted)], check=True, timeout=300)
    members = _members(scripted)
    folder = members[0][0].split("/")[0]
    twin = twin_zip(tmp_path / "twin.pth", members,
                    [(f"{folder}/data.pkl", 100), (f"{folder}/version", 2)] + [(f"{folder}/pad{k}", 0)
                                                                                for k in range(len(members))])
    for path, says in ((str(scripted), "TorchScript"), (twin, "two zip readers would read two different archives")):
        with pytest.raises(CheckpointError, match=says):
            read_checkpoint(path)
        assert not marker.exists()
    torch.jit.load(str(scripted))  # the control: the file is a real attack
    assert marker.read_bytes() == b"pwned"


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_storage_size_only_pythons_directory_states_is_refused_in_a_subprocess(tmp_path):
    """The same trick for sizes: Python's directory says data/0 holds 16 MB, torch's the real 16
    bytes (torch 2.0 segfaulted, 2.1 read the heap)."""
    members = [(n, program(d((s("w"), tensor(numel=1 << 22, size=(1 << 22,))))) if n.endswith("data.pkl") else v)
               for n, v in _members(in_zip(tmp_path / "seed.pth", b""))]
    view = [(n, 1 << 24 if n.endswith("/data/0") else len(v)) for n, v in members]
    twin = twin_zip(tmp_path / "twin-sizes.pth", members, view)
    done = subprocess.run([sys.executable, "-c", _CHILD, twin], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "two zip readers would read two different archives" in out["twin-sizes.pth"], out


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_configdict_over_shared_lists_is_refused_before_it_copies_them(tmp_path):
    """A 1.7 KB file: ``ConfigDict({'a': L})``, L 26 levels of ``[x, x]`` (memo references).
    Read once each, they are small; ConfigDict copies along every path (2**26 lists)."""
    body = pickle.EMPTY_LIST + put(0) + pickle.POP
    for _ in range(26):
        body += pickle.EMPTY_LIST + pickle.MARK + get(0) + get(0) + pickle.APPENDS + put(0) + pickle.POP
    path = in_zip(tmp_path / "cfgdag.pth", program(body + d((s("meta"), call(g(CD), d((s("a"), get(0))))))))
    assert os.path.getsize(path) < 4096
    done = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "counted along every path" in out["cfgdag.pth"] and out["maxrss_mb"] < 200, out


def _shared_dicts(levels: int) -> bytes:
    """A dict ``{'a': d, 'b': d}`` over ``levels`` levels of the same (memo) dict: ``2 ** levels`` paths."""
    body = pickle.EMPTY_DICT + put(0) + pickle.POP
    for _ in range(levels):
        body += pickle.EMPTY_DICT + s("a") + get(0) + pickle.SETITEM + s("b") + get(0) + pickle.SETITEM + put(0) \
            + pickle.POP
    return body + get(0)


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_configdict_copies_only_a_config_sized_dag(tmp_path):
    """2 ** 18 paths through shared dicts: under :data:`MAX_EXPANDED`, so plain data keeps them
    (shared, small); a ConfigDict would copy a ConfigDict per path (about 100 MB), so it is refused."""
    plain = in_zip(tmp_path / "plain-dag.pth", program(d((s("meta"), _shared_dicts(18)))))
    config = in_zip(tmp_path / "config-dag.pth", program(d((s("meta"), call(g(CD), _shared_dicts(18))))))
    done = subprocess.run([sys.executable, "-c", _CHILD, plain, config], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["plain-dag.pth"] == "loaded", out
    assert "a ConfigDict holds more than 65536 objects counted along every path" in out["config-dag.pth"], out
    assert out["maxrss_mb"] < 60, out


def _safetensors(path, header: bytes) -> str:
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return str(path)


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_safetensors_header_is_parsed_only_at_a_checkpoint_size(tmp_path):
    """JSON makes tens of bytes of Python objects per byte of header: 300k empty tensors, 80k
    tensors, 3M empty lists are each refused before (or as soon as) the header is parsed; 2000
    tensors (a Swin-G) load."""
    def entries(n):
        return b"{" + b",".join(b'"t%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % k for k in range(n)) + b"}"

    files = [_safetensors(tmp_path / "many.safetensors", entries(300_000)),
             _safetensors(tmp_path / "more.safetensors", entries(80_000)),
             _safetensors(tmp_path / "lists.safetensors",
                          b'{"t":{"dtype":"F32","shape":[' + b",".join([b"[]"] * 3_000_000) + b'],"data_offsets":[0,0]}}'),
             _safetensors(tmp_path / "swin-g.safetensors", entries(2000))]
    done = subprocess.run([sys.executable, "-c", _CHILD, *files], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "more than a checkpoint of 65536 tensors may hold" in out["many.safetensors"], out
    assert "it names 80000 tensors, more than the 65536" in out["more.safetensors"], out
    assert "more than a checkpoint of 65536 tensors may hold" in out["lists.safetensors"], out
    assert out["swin-g.safetensors"] == "loaded", out
    assert out["maxrss_mb"] < 200, out


def _lput(n: int) -> bytes:
    return pickle.LONG_BINPUT + n.to_bytes(4, "little")


def _lget(n: int) -> bytes:
    return pickle.LONG_BINGET + n.to_bytes(4, "little")


@pytest.mark.parametrize("row, items, one", [
    ("collections.defaultdict", d(*[(i(k), NONE) for k in range(65536)]), lambda f, x: f + t(NONE, x) + pickle.REDUCE),
    ("builtins.set", l(*[i(k) for k in range(65536)]), lambda f, x: f + t(x) + pickle.REDUCE),
    ("collections.OrderedDict", l(*[t(i(k), NONE) for k in range(65536)]), lambda f, x: f + t(x) + pickle.REDUCE),
    ("collections.Counter", d(*[(i(k), i(1)) for k in range(65536)]), lambda f, x: f + t(x) + pickle.REDUCE),
])
def test_a_row_that_copies_a_shared_container_spends_the_budget(tmp_path, row, items, one):
    """One container of 65536 items, copied by a row 300 times through the memo (7 bytes a copy):
    3.5 GB from a 272 KB file before each copy was charged."""
    body = g(row) + put(0) + pickle.POP + items + put(1) + pickle.POP + one(get(0), get(1)) * 300 + d()
    path = in_zip(tmp_path / "copies.pth", program(body))
    with pytest.raises(CheckpointError, match=rf"{row}: \d+ more bytes would pass what this load may make"):
        read_checkpoint(path)


@pytest.mark.slow  # the payload runs in a subprocess
@pytest.mark.parametrize("row, says", [("configdict", "a ConfigDict holds more than 65536 objects"),
                                       ("messagehub", "the data holds more than 1048576 objects"),
                                       ("metadata", "a state dict's _metadata: 6553600 more bytes would pass")])
def test_records_over_one_shared_container_are_checked_once(tmp_path, row, says):
    """A list of 4000 records over one list of 10**6 items (1 MB; a state dict's ``_metadata``: a
    dict of 65536): each was checked whole when made, 4 * 10**9 steps (about an hour); now what is
    shared is checked once when made, and what the records hold counted along every path is
    bounded when they are made real. Bounded by the child's timeout. (The archive holds a 16 MB
    storage: 10**6 list slots are more than a 1 MB file may make, so that the records' checks,
    not the unpickler's budget, are what refuses it.)"""
    if row == "metadata":
        shared = d(*[(i(k), NONE) for k in range(65536)])
    else:
        shared = pickle.EMPTY_LIST + pickle.MARK + NONE * 10 ** 6 + pickle.APPENDS
    body = s("a") + put(2) + pickle.POP + shared + put(1) + pickle.POP
    if row == "configdict":
        body += g(CD) + put(0) + pickle.POP
        one = get(0) + d((get(2), get(1))) + pickle.TUPLE1 + pickle.REDUCE + pickle.POP
    elif row == "messagehub":
        body += g("mmengine.logging.message_hub.MessageHub") + put(0) + pickle.POP + s("_runtime_info") + put(2)
        one = get(0) + pickle.EMPTY_TUPLE + pickle.NEWOBJ + d((get(2), get(1))) + pickle.BUILD + pickle.POP
        body += pickle.POP
    else:
        body += g("collections.OrderedDict") + put(0) + pickle.POP + s("_metadata") + put(2) + pickle.POP
        one = get(0) + pickle.EMPTY_TUPLE + pickle.REDUCE + d((get(2), get(1))) + pickle.BUILD + pickle.POP
    records = pickle.EMPTY_LIST + pickle.MARK + one.removesuffix(pickle.POP) * 4000 + pickle.APPENDS
    path = in_zip(tmp_path / f"{row}.pth", program(body + d((s("records"), records))), torch.zeros(1 << 22))
    done = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert says in json.loads(done.stdout.strip().splitlines()[-1])[f"{row}.pth"]


def test_text_counts_wherever_it_hangs(tmp_path):
    """One 1 MiB string hung 1000 x 1000 times through two shared lists: about 10**6 objects along
    every path (under :data:`records.MAX_EXPANDED`), and 1 TB for whoever prints it."""
    body = s("x" * (1 << 20)) + put(0) + pickle.POP
    body += pickle.EMPTY_LIST + pickle.MARK + get(0) * 1000 + pickle.APPENDS + put(1) + pickle.POP
    body += d((s("meta"), pickle.EMPTY_LIST + pickle.MARK + get(1) * 1000 + pickle.APPENDS))
    path = in_zip(tmp_path / "text.pth", program(body))
    with pytest.raises(CheckpointError, match="text: 1048576 more bytes would pass"):
        read_checkpoint(path)
    once = in_zip(tmp_path / "once.pth", program(d((s("meta"), l(s("x" * (1 << 20)))))))
    assert read_checkpoint(once)["meta"] == ["x" * (1 << 20)]  # (text once: as in the file)


def test_tuple_keys_are_few_and_their_int_parts_small(tmp_path):
    """CPython's tuple hash can be solved for a last int part: 90 000 keys (a, b) of one hash took
    74 s to insert. Int parts lie below 2**32 and a load inserts at most 4096 tuple keys."""
    big = in_zip(tmp_path / "big.pth", program(d((t(i(1), i(2 ** 32)), NONE))))
    with pytest.raises(CheckpointError, match=r"ints in \[0, 2\*\*32\), found \(1, 4294967296\)"):
        read_checkpoint(big)
    many = in_zip(tmp_path / "many.pth", program(d(*[(t(s("k"), i(k)), NONE) for k in range(4097)])))
    with pytest.raises(CheckpointError, match="SETITEMS: more than 4096 tuple keys in one load"):
        read_checkpoint(many)
    few = in_zip(tmp_path / "few.pth", program(d(*[(t(s("k"), i(k)), NONE) for k in range(4096)])))
    assert len(read_checkpoint(few)) == 4096


def test_a_zip_of_very_many_records_is_refused_from_its_end_record(tmp_path):
    """70 000 empty records the pickle never names: zip readers hold each in memory (300 000 held
    765 MB for a 38 MB file); the end record's count refuses it before any reader lists them."""
    path = tmp_path / "records.pth"
    torch.save({"w": torch.ones(1)}, path)
    with zipfile.ZipFile(path) as z:
        members = [(x.filename, z.read(x.filename)) for x in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data)
        for k in range(70_000):
            z.writestr(f"{members[0][0].split('/')[0]}/x{k}", b"")
    with pytest.raises(CheckpointError, match=rf"the archive declares {70_000 + len(members)} records, more than the 65536"):
        read_checkpoint(str(path))


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_central_directory_longer_than_its_declared_count_is_refused_before_zipfile_lists_it(tmp_path):
    """The end record declares the archive's 7 records, and its central directory holds 600 000
    more (47 bytes each): Python's zipfile walks the directory by its size, not the count, and
    made all 600 000 before the count was compared (1M: 360 MB and 19 s for a 45 MB file). Now
    the directory's entries are counted first, as zipfile walks it; in a subprocess."""
    import struct

    path = in_zip(tmp_path / "long-directory.pth", program(d((s("w"), NONE))))
    data = open(path, "rb").read()
    end = data.rindex(b"PK\x05\x06")
    _, _, _, here, total, size, offset, _ = struct.unpack_from("<4sHHHHIIH", data, end)
    entry = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0) + b"z"
    directory = data[offset:offset + size] + entry * 600_000
    with open(path, "wb") as f:
        f.write(data[:offset] + directory + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, here, total,
                                                          len(directory), offset, 0))
    done = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert f"the archive's central directory holds more than 65536 records (its end record declares {total})" \
        in out["long-directory.pth"], out
    assert out["maxrss_mb"] < 100, out


def test_a_storage_located_on_meta_is_refused(tmp_path):
    """A storage whose location is ``'meta'`` (torch.save never writes one): read without a
    ``map_location`` (mmengine's ``load_checkpoint`` default) its tensors held no values, and a model
    built on meta reported every tensor loaded while it kept none; into a real model, torch's
    ``Cannot copy out of meta tensor`` from inside ``load_state_dict``."""
    from swin_backbone import SwinBackbone
    from swin_backbone.checkpoint import load_checkpoint

    pid = t(s("storage"), g("torch.FloatStorage"), s("0"), s("meta"), i(4)) + pickle.BINPERSID
    path = in_zip(tmp_path / "meta.pth", program(d((s("w"), call(
        g("torch._utils._rebuild_tensor_v2"), pid, i(0), t(i(4)), t(i(1)), FALSE, call(g("collections.OrderedDict")))))))
    for map_location in (None, "cpu"):
        with pytest.raises(CheckpointError, match="storage location 'meta': a storage of the file holds data"):
            read_checkpoint(path, map_location=map_location)
    with torch.device("meta"):
        model = SwinBackbone("tiny", depths=(1, 1, 1, 1))
    state = {k: torch.zeros(v.shape) for k, v in SwinBackbone("tiny", depths=(1, 1, 1, 1)).state_dict().items()}
    torch.save(state, tmp_path / "state.pth")
    with zipfile.ZipFile(tmp_path / "state.pth") as z:
        members = [(x.filename, z.read(x.filename)) for x in z.infolist()]
    with zipfile.ZipFile(tmp_path / "on-meta.pth", "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data.replace(b"X\x03\x00\x00\x00cpu", b"X\x04\x00\x00\x00meta")
                       if name.endswith("data.pkl") else data)
    with pytest.raises(CheckpointError, match="storage location 'meta'"):
        load_checkpoint(model, str(tmp_path / "on-meta.pth"), map_location=None, logger=None)
    assert load_checkpoint(model, str(tmp_path / "state.pth"), map_location=None, logger=None).complete
    assert not any(p.is_meta for p in model.parameters())


def test_a_refused_load_leaves_torch_s_thread_local_map_location(tmp_path):
    """torch (>= 2.4) sets ``_serialization_tls.map_location`` for a load and leaves it set when the
    unpickler raises; later rebuilds in the thread would map there."""
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is None:
        pytest.skip("this torch keeps no serialization thread-local")
    path = in_zip(tmp_path / "code.pth", program(call(g("os.system"), s("true"))))
    before = tls.map_location
    with pytest.raises(CheckpointError, match="asks to run code"):
        read_checkpoint(path, map_location="cpu")
    assert tls.map_location is before


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_legacy_text_line_is_read_in_blocks(tmp_path):
    """A legacy file's text opcodes read a line: io read it a byte per Python call (26 s for
    8 MB; 32 MB here, bounded by the child's timeout). Lines across blocks read whole."""
    from swin_backbone.checkpoint.unpickler import _PythonReads

    lines = [b"a" * 65535 + b"\n", b"b" * 65536 + b"\n", b"\n", b"c" * 70000]
    (tmp_path / "lines").write_bytes(b"".join(lines))
    with _PythonReads(str(tmp_path / "lines"), "r") as f:
        assert [f.readline() for _ in range(5)] == lines + [b""]
        f.seek(0)
        assert f.readline(10) == b"a" * 10 and f.readline() == b"a" * 65525 + b"\n"
    path = legacy(tmp_path / "line.pth", program(pickle.UNICODE + b"x" * (32 << 20) + b"\n"))
    done = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["line.pth"] == "loaded"


_RREFS = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/pg", rank=0, world_size=1)
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    import torch.distributed._shard.sharded_tensor.api as api
    from swin_backbone.checkpoint import CheckpointError
    from swin_backbone.checkpoint.files import read_torch_file
    from swin_backbone.mmlab.fsdp import sharded_classes
    out = {}
    for rrefs in (False, True):
        st = sharded_tensor.zeros(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 4)
        st._init_rrefs = rrefs
        path = sys.argv[1] + f"/rank0-{rrefs}.pth"
        torch.save({"w": st}, path)
        before = api._sharded_tensor_current_id
        try:
            got = read_torch_file(path, "torch-zip", trusted=sharded_classes())["w"]
            out[str(rrefs)] = type(got).__name__ + " " + str(got.local_tensor().tolist())
        except CheckpointError as err:
            out[str(rrefs)] = str(err)
        out[str(rrefs) + " id"] = api._sharded_tensor_current_id - before
    dist.destroy_process_group()
    print(json.dumps(out))
""")


@pytest.mark.slow  # the payload runs in a subprocess
def test_an_fsdp_shard_that_asks_for_rpc_is_refused_before_it_registers(tmp_path):
    """A ShardedTensor saved with ``init_rrefs=True``: its ``__setstate__`` registers it in
    torch's process-wide map (and with an RPC agent calls the other workers); a shard as
    ``torch.save`` writes it (``init_rrefs=False``) loads."""
    pytest.importorskip("mmengine")
    done = subprocess.run([sys.executable, "-c", _RREFS, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["False"] == "ShardedTensor [0.0, 0.0, 0.0, 0.0]", out
    assert "refused: a ShardedTensor's state: expected (shards, metadata, process group state, spec, False)" \
        in out["True"] and "nothing in it ran" not in out["True"], out
    assert out["True id"] == 0, out


def test_a_legacy_storage_its_data_never_fills_is_refused(tmp_path):
    """torch allocates a legacy file's storages uninitialised and fills those the keys after the
    pickle name: one it never fills would hand back process memory."""
    n = 4096
    pid = t(s("storage"), g("torch.FloatStorage"), s("0"), s("cpu"), i(n), NONE) + pickle.BINPERSID
    body = program(d((s("w"), call(g("torch._utils._rebuild_tensor_v2"), pid, i(0), t(i(n)), t(i(1)), FALSE,
                                   call(g("collections.OrderedDict"))))))
    path = legacy(tmp_path / "unfilled.pth", body, storages=b"\0" * (4 * n))
    with pytest.raises(CheckpointError, match="does not fill"):
        read_checkpoint(path)


_FUZZ = textwrap.dedent("""
    import io, json, os, pickle, random, resource, signal, sys, zipfile
    sys.path.insert(0, sys.argv[1])
    from pickles import FALSE, NONE, TRUE, b, build, call, d, g, i, l, new, program, s, t
    from swin_backbone.checkpoint import CheckpointError, read_checkpoint, records
    from swin_backbone.checkpoint.records import materialize
    from swin_backbone.checkpoint.unpickler import InertUnpickler

    marker, checkpoint, count, seed = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    rng = random.Random(seed)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = sorted(records.ENTRIES) + ["builtins.exec", "posix.system", "builtins.eval"]
    code = [s(f"open({marker!r}, 'w').close()"), s(f"touch {marker}"), b(b"touch " + marker.encode())]

    def value(depth=0):
        kind = rng.randrange(10 if depth < 3 else 6)
        if kind == 0: return rng.choice([NONE, TRUE, FALSE])
        if kind == 1: return i(rng.choice([0, 1, -1, 2 ** 31, 2 ** 40, 3]))
        if kind == 2: return s(rng.choice(["x", "__class__", "__setstate__", "__array_interface__", "mean", "min",
                                           "f8", "O8", "S", "storage", "cpu", "0", "latin1", "_metadata"]))
        if kind == 3: return rng.choice(code)
        if kind == 4: return b(bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 8, 16]))))
        if kind == 5: return g(rng.choice(rows))
        if kind == 6: return t(*[value(depth + 1) for _ in range(rng.randrange(4))])
        if kind == 7: return l(*[value(depth + 1) for _ in range(rng.randrange(3))])
        if kind == 8: return d(*[(value(depth + 1), value(depth + 1)) for _ in range(rng.randrange(3))])
        return shaped(depth + 1)

    def shaped(depth):
        # a call shaped to the stack: a row with 0-4 arguments, then maybe a BUILD
        row = g(rng.choice(rows))
        args = [value(depth) for _ in range(rng.randrange(5))]
        body = (call if rng.random() < 0.7 else new)(row, *args)
        if rng.random() < 0.4:
            body = build(body, value(depth))
        return body

    def alarm(*_):
        raise TimeoutError("hang")
    signal.signal(signal.SIGALRM, alarm)
    outcomes = {"data": 0, "refused": 0}
    for n in range(count):
        body = program(d((s("v"), shaped(0))))
        signal.alarm(5)
        try:
            materialize(InertUnpickler(io.BytesIO(body)).load())
            outcomes["data"] += 1
        except CheckpointError:
            outcomes["refused"] += 1
        finally:
            signal.alarm(0)
    # mutations of a real Runner checkpoint's pickle: rows spliced in at random opcodes
    import pickletools
    with zipfile.ZipFile(checkpoint) as z:
        members = [(info.filename, z.read(info.filename)) for info in z.infolist()]
    data = next(v for k, v in members if k.endswith("data.pkl"))
    starts = [pos for _, _, pos in pickletools.genops(data)]
    for n in range(count // 4):
        at = starts[rng.randrange(1, len(starts) - 1)]
        mutant = data[:at] + shaped(0) + pickle.POP + data[at:] if rng.random() < 0.5 else \\
            data[:at] + bytes([rng.choice(b"RbQ\\x81\\x85\\x86su(te")]) + data[at + 1:]
        path = os.path.join(os.path.dirname(marker), f"m{n}.pth")
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for name, content in members:
                z.writestr(name, mutant if name.endswith("data.pkl") else content)
        signal.alarm(5)
        try:
            read_checkpoint(path)
            outcomes["data"] += 1
        except CheckpointError:
            outcomes["refused"] += 1
        finally:
            signal.alarm(0)
        os.remove(path)
    outcomes["maxrss_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps(outcomes))
""")


@pytest.mark.slow  # the payload runs in a subprocess
def test_a_bounded_fuzz_of_composed_rows_and_mutated_runner_checkpoints(tmp_path):
    """Seeded: 1200 programs of rows with calls shaped to the stack, 300 real-checkpoint mutants.
    Each is data or a CheckpointError; never code (the marker), a signal, a hang or 1 GB."""
    from .test_code_refused import _train

    _train(tmp_path / "runner", max_epochs=1)
    checkpoint = tmp_path / "runner" / "epoch_1.pth"
    marker = tmp_path / "ran"
    done = subprocess.run([sys.executable, "-c", _FUZZ, os.path.dirname(__file__), str(marker), str(checkpoint),
                           "1200", "60"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["refused"] > 0 and out["data"] + out["refused"] == 1500, out
    assert out["maxrss_mb"] < 1024, out
    assert not marker.exists()
