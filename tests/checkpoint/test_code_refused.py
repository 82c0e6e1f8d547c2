"""No checkpoint runs code: a corpus of hostile pickles, each alone and inside the data the
table reads (a state dict, a HistoryBuffer's state, a numpy array), refused through every reader
of the package, with a :class:`CheckpointError` naming the global and no side effect; real
mmengine Runner checkpoints (a short real training writes them) read as data through mmengine's
own ``load_checkpoint`` and ``--resume``; a bounded, seeded fuzz of real mmengine and timm
checkpoints. Gadget chains built from the table's own rows: test_gadget_chains.py. Runs on every
stack (Makefile COMPAT_CORE)."""
from __future__ import annotations

import builtins
import functools
import importlib
import io
import operator
import os
import pickle
import pickletools
import random
import signal
import struct
import subprocess
import uuid
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from swin_backbone import CheckpointError, SwinBackbone, load_checkpoint, torch_compat
from swin_backbone.checkpoint import read_checkpoint
from swin_backbone.checkpoint.records import ASKS_FOR_CODE

from ..helpers import TINY

HistoryBuffer = pytest.importorskip("mmengine.logging.history_buffer").HistoryBuffer


# ---------------------------------------------------------------- the corpus
class _Call:
    """Pickles as ``target(*args)`` (its ``__reduce__``): what a hostile file asks the unpickler to run."""

    def __init__(self, target, *args):
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def _touch(marker):
    return f"open({str(marker)!r}, 'w').close()"


def _npy_with_pickle(tmp_path, marker):
    """A .npy file holding a pickled object array whose element runs ``touch marker``."""
    path = tmp_path / "inner.npy"
    arr = np.empty(1, dtype=object)
    arr[0] = _Call(os.system, f"touch {marker}")
    np.save(path, arr, allow_pickle=True)
    return str(path)


#: id -> (target, args(marker, tmp_path)); every target is a global a pickle names.
CORPUS = {
    "os.system": (os.system, lambda m, t: (f"touch {m}",)),
    "eval": (builtins.eval, lambda m, t: (_touch(m),)),
    "exec": (builtins.exec, lambda m, t: (_touch(m),)),
    "compile": (builtins.compile, lambda m, t: (_touch(m), "x", "exec")),
    "__import__": (builtins.__import__, lambda m, t: ("os",)),
    "getattr": (builtins.getattr, lambda m, t: (HistoryBuffer, "__init__")),
    "attrgetter": (operator.attrgetter, lambda m, t: ("system",)),
    "methodcaller": (operator.methodcaller, lambda m, t: ("system", f"touch {m}")),
    "partial": (functools.partial, lambda m, t: (os.system, f"touch {m}")),
    "import_module": (importlib.import_module, lambda m, t: ("os",)),
    "subprocess.call": (subprocess.call, lambda m, t: (["touch", str(m)],)),
    "subprocess.Popen": (subprocess.Popen, lambda m, t: (["touch", str(m)],)),
    "pickle.loads": (pickle.loads, lambda m, t: (pickle.dumps(_Call(os.system, f"touch {m}")),)),
    "numpy.load": (np.load, lambda m, t: (_npy_with_pickle(t, m), None, True)),
    "torch.load": (torch.load, lambda m, t: (_npy_with_pickle(t, m),)),
    "torch.hub.load": (torch.hub.load, lambda m, t: (str(t), "evil")),
    "torch.jit.load": (torch.jit.load, lambda m, t: (str(t / "x.pt"),)),
    # torch's rebuild internals: one that unpickles without weights_only, one allowed rebuild handed code
    "torch.storage._load_from_bytes": (torch.storage._load_from_bytes,
                                       lambda m, t: (pickle.dumps(_Call(os.system, f"touch {m}")),)),
    "_rebuild_from_type_v2+os.system": (torch._tensor._rebuild_from_type_v2,
                                        lambda m, t: (os.system, torch.Tensor, (f"touch {m}",), {}), os.system),
}


def _named_in(path, qualname) -> str:
    """The global the saved file names for ``qualname``, read with ``pickletools``, under its
    Python 3 name as unpickling maps protocol 2's (``__builtin__`` -> ``builtins``)."""
    import _compat_pickle

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found = [tuple(arg.split(" ")) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]
    module, name = next(g for g in found if g[1] == qualname)
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _inside(evil, how):
    """``evil`` alone, or inside what the allow-list holds (a state dict beside a tensor, a
    HistoryBuffer's state, a numpy object array, a message hub)."""
    if how == "alone":
        return {"state_dict": evil}
    if how == "state_dict":
        return {"state_dict": OrderedDict(weight=torch.ones(2), evil=evil)}
    if how == "history_buffer":
        buf = HistoryBuffer()
        buf.update(1.0)
        buf.__dict__["evil"] = evil
        return {"state_dict": OrderedDict(weight=torch.ones(2)), "message_hub": {"log_scalars": {"loss": buf}}}
    arr = np.empty(1, dtype=object)
    arr[0] = evil
    return {"state_dict": OrderedDict(weight=torch.ones(2)), "meta": {"numpy": arr}}


def _refused(path, name, marker, read=read_checkpoint, code=True):
    with pytest.raises(CheckpointError) as info:
        read(str(path))
    message = str(info.value)
    assert str(path) in message and (ASKS_FOR_CODE in message or not code) and name in message, message
    assert "nothing in it ran" in message, message
    assert not marker.exists()
    return message


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_corpus_is_refused_naming_the_global(tmp_path, case):
    target, args, named = (CORPUS[case] + (None,))[:3]
    named = named or target
    marker = tmp_path / "ran"
    for how in ("alone", "state_dict", "history_buffer", "numpy"):
        path = tmp_path / f"{case}-{how}.pth"
        torch.save(_inside(_Call(target, *args(marker, tmp_path)), how), path)
        name = _named_in(path, named.__qualname__)
        if how == "numpy":  # the object array holding it is refused first: object dtypes are never read
            assert "object" in _refused(path, "numpy.dtype('O8'", marker, code=False)
        else:
            _refused(path, name, marker)
        if torch_compat.torch_version() >= (2, 6):  # torch's own default refuses it too (nothing of ours added)
            with pytest.raises(pickle.UnpicklingError):
                torch.load(path)
        assert not marker.exists()
    # the legacy (non-zip) container: same
    torch.save(_inside(_Call(target, *args(marker, tmp_path)), "alone"), tmp_path / "legacy.pth",
               _use_new_zipfile_serialization=False)
    _refused(tmp_path / "legacy.pth", name, marker)


def _s(x: str) -> bytes:
    b = x.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def _g(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _getattr_chain(marker, holder=("mmengine.logging.history_buffer", "HistoryBuffer")) -> bytes:
    """The issue's payload: ``getattr(getattr(getattr, '__self__'), 'exec')`` stored as a
    HistoryBuffer's ``__setstate__``, called by a second BUILD."""
    return (b"\x80\x02" + _g(*holder) + b")" + pickle.NEWOBJ
            + pickle.EMPTY_DICT + _s("__setstate__") + _g("builtins", "getattr")
            + _g("builtins", "getattr") + _g("__builtin__", "getattr") + _s("__self__") + pickle.TUPLE2 + pickle.REDUCE
            + _s("exec") + pickle.TUPLE2 + pickle.REDUCE + pickle.SETITEM + pickle.BUILD
            + _s(_touch(marker)) + pickle.BUILD + pickle.STOP)


def _in_zip(tmp_path, name, data_pkl: bytes):
    """A torch zip checkpoint whose pickle is ``data_pkl``."""
    path = tmp_path / name
    torch.save({}, path)
    _rewrite(path, data_pkl)
    return path


def _rewrite(path, data_pkl: bytes) -> None:
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data_pkl if name.endswith("data.pkl") else data)


def _data_pkl(path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("container", ["raw-pickle", "zip"])
def test_the_issues_getattr_chain_is_refused(tmp_path, container):
    marker = tmp_path / "pwned"
    payload = _getattr_chain(marker)
    path = tmp_path / "evil.pth"
    if container == "zip":
        path = _in_zip(tmp_path, "evil.pth", payload)
    else:
        path.write_bytes(payload)
    message = _refused(path, GETATTR_CHAIN, marker)
    assert "Invalid magic number" not in message
    assert not marker.exists()
    # the plain unpickler runs it: the payload is a real attack
    pickle.loads(payload)
    assert marker.exists()


#: How the refusal of ``getattr(getattr, '__self__')`` names it.
GETATTR_CHAIN = "builtins.getattr(the global builtins.getattr, '__self__')"


def test_the_chain_through_every_path_of_the_package(tmp_path):
    """load_checkpoint, init_cfg Pretrained through mmdet's MODELS, the converter CLI."""
    marker = tmp_path / "pwned"
    path = _in_zip(tmp_path, "evil.pth", _getattr_chain(marker))
    name = GETATTR_CHAIN
    _refused(path, name, marker, read=lambda p: load_checkpoint(SwinBackbone(**TINY), p, logger=None))
    mmdet_models = pytest.importorskip("mmdet.registry").MODELS
    from mmengine.registry import DefaultScope

    with DefaultScope.overwrite_default_scope("mmdet"):  # (a Runner of another test may have left its scope current)
        model = mmdet_models.build(dict(TINY, type="SwinBackbone", init_cfg=dict(type="Pretrained",
                                                                                 checkpoint=str(path))))
    _refused(path, name, marker, read=lambda p: model.init_weights())
    from swin_backbone.tools.convert_checkpoint import main

    err = io.StringIO()
    import contextlib

    with contextlib.redirect_stderr(err):
        assert main([str(path), str(tmp_path / "out.pth")]) == 1
    assert ASKS_FOR_CODE in err.getvalue() and name in err.getvalue() and not marker.exists()


@pytest.mark.parametrize("holder", [("collections", "OrderedDict"), ("mmengine.config.config", "ConfigDict"),
                                    ("mmengine.logging.message_hub", "MessageHub")])
def test_the_chain_inside_other_allowed_classes(tmp_path, holder):
    marker = tmp_path / "pwned"
    path = _in_zip(tmp_path, "evil.pth", _getattr_chain(marker, holder))
    message = _refused(path, "", marker)
    assert GETATTR_CHAIN in message or "creates the global" in message, message


def test_mmengine_loads_through_the_package_and_torch_is_unchanged(tmp_path):
    """mmengine's local, URL and named loaders are ours; pavi / s3 stay mmengine's."""
    from mmengine.runner.checkpoint import CheckpointLoader

    from swin_backbone.checkpoint.mmengine_schemes import load_from_swin_backbone

    for path in ("/x/y.pth", "y.pth", "http://h/y.pth", "https://h/y.pth", "torchvision://resnet50",
                 "open-mmlab://x", "mmcls://x"):
        assert CheckpointLoader._get_checkpoint_loader(path) is load_from_swin_backbone, path
    for path in ("pavi://x/y.pth", "s3://b/y.pth"):
        assert CheckpointLoader._get_checkpoint_loader(path) is not load_from_swin_backbone, path


# ---------------------------------------------------------------- real Runner checkpoints
def _train(work_dir, max_epochs, resume_from=None):
    """A short real mmengine Runner training (a linear model, SGD + two schedulers, the
    message hub logging); returns the runner."""
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    class Linear(BaseModel):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 1)

        def forward(self, x, mode="tensor"):
            out = self.fc(x)
            return dict(loss=out.pow(2).mean()) if mode == "loss" else out

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return dict(x=torch.full((2,), float(i)))

    runner = Runner(
        model=Linear(), work_dir=str(work_dir), experiment_name=f"code_refused_{uuid.uuid4().hex[:8]}",  # (mmengine keys its hub and visualizer by it)
        train_dataloader=dict(dataset=Data(), batch_size=2, sampler=dict(type="DefaultSampler", shuffle=True),
                              collate_fn=dict(type="default_collate")),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1, momentum=0.9)),
        param_scheduler=[dict(type="LinearLR", start_factor=0.1, by_epoch=True, begin=0, end=1),
                         dict(type="MultiStepLR", milestones=[1], by_epoch=True)],
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1), logger=dict(type="LoggerHook",
                                                                                           interval=1)),
        randomness=dict(seed=0), load_from=resume_from, resume=resume_from is not None, log_level="WARNING")
    runner.train()
    return runner


@pytest.fixture(scope="module")
def runner_checkpoint(tmp_path_factory):
    pytest.importorskip("mmengine.runner")
    work_dir = tmp_path_factory.mktemp("runner")
    _train(work_dir, max_epochs=2)
    return work_dir / "epoch_2.pth"


def test_a_runner_checkpoint_holds_what_the_allow_list_was_written_for(runner_checkpoint):
    """The globals mmengine's Runner writes, disassembled: rows of the table (records.py)."""
    names = set()
    data = _data_pkl(runner_checkpoint)
    ops = list(pickletools.genops(data))
    for op, arg, _ in ops:
        if op.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
    assert "__builtin__.getattr" in names and "mmengine.logging.history_buffer.HistoryBuffer" in names
    getattrs = [ops[i + 3][1] for i, (op, arg, _) in enumerate(ops) if op.name == "GLOBAL" and arg.endswith("getattr")]
    assert getattrs and all(name in ("min", "max", "current", "mean") for name in getattrs)


def test_a_runner_checkpoint_loads_weights_only_through_mmengine(runner_checkpoint, tmp_path):
    from mmengine.runner import load_checkpoint as mmengine_load_checkpoint

    ours = read_checkpoint(str(runner_checkpoint))
    hub = ours["message_hub"]["log_scalars"]
    assert isinstance(hub["train/loss"], HistoryBuffer) and np.isfinite(hub["train/loss"].statistics("mean"))
    assert ours["param_schedulers"][1]["milestones"] == {1: 1}
    model = torch.nn.Module()
    model.fc = torch.nn.Linear(2, 1)
    mmengine_load_checkpoint(model, str(runner_checkpoint), map_location="cpu")  # through the package's reader
    torch.testing.assert_close(model.fc.weight, ours["state_dict"]["fc.weight"])
    if torch_compat.torch_version() >= (2, 6):  # torch's own default still refuses it: nothing added to its list
        with pytest.raises(pickle.UnpicklingError, match="HistoryBuffer|getattr"):
            torch.load(runner_checkpoint)
    # --resume: the Runner reads it, message hub, optimizer and schedulers included
    runner = _train(tmp_path, max_epochs=3, resume_from=str(runner_checkpoint))
    assert runner.epoch == 3 and runner.iter == 6
    assert len(runner.message_hub.get_scalar("train/loss").data[0]) == 6  # 4 iterations resumed + 2 new


def test_resume_drops_the_config_text_mmengine_would_execute(runner_checkpoint, tmp_path):
    """``meta['config']`` (mmcv 1.x / early mmengine runs) is Python that ``Runner.resume``
    executes: dropped with a warning naming it; the rest of the resume is as before."""
    from mmengine.config import Config

    marker = tmp_path / "ran"
    checkpoint = read_checkpoint(str(runner_checkpoint))
    checkpoint["meta"]["config"] = f"open({str(marker)!r}, 'w').close()\ngpu_ids = [0]\n"
    path = tmp_path / "old_meta.pth"
    torch.save(checkpoint, path)
    with pytest.warns(UserWarning, match=r"meta\['config'\] dropped"):
        runner = _train(tmp_path / "resumed", max_epochs=3, resume_from=str(path))
    assert not marker.exists()
    assert runner.epoch == 3 and runner.iter == 6
    assert len(runner.message_hub.get_scalar("train/loss").data[0]) == 6
    # the control: what mmengine's resume would have run
    Config.fromstring(checkpoint["meta"]["config"], file_format=".py")
    assert marker.exists()


def test_a_hostile_runner_checkpoint_is_refused_through_mmengine(runner_checkpoint, tmp_path):
    """The chain inside a real Runner checkpoint's message hub, through mmengine's own loader."""
    marker = tmp_path / "pwned"
    data = _data_pkl(runner_checkpoint)
    chain = _getattr_chain(marker)[2:-1]  # the payload's opcodes, without PROTO and STOP
    evil = data[:2] + pickle.EMPTY_DICT + _s("evil") + chain + pickle.SETITEM + pickle.POP + data[2:]
    path = tmp_path / "evil_runner.pth"
    path.write_bytes(runner_checkpoint.read_bytes())
    _rewrite(path, evil)
    _refused(path, GETATTR_CHAIN, marker)
    from mmengine.runner import load_checkpoint as mmengine_load_checkpoint

    _refused(path, GETATTR_CHAIN, marker, read=lambda p: mmengine_load_checkpoint(torch.nn.Linear(2, 1), p,
                                                                                    map_location="cpu"))
    assert not marker.exists()


# ---------------------------------------------------------------- fuzz
#: Opcodes a mutation may write: the ones that name or call objects, and a few that move data.
_OPS = b"c\x93RbioN\x81\x82\x83\x84(te}]sua)q0h.\x85\x86\x87"


def _mutants(data: bytes, rng: random.Random, count: int):
    ops = [pos for _, _, pos in pickletools.genops(data)]
    for _ in range(count):
        i = rng.randrange(1, len(ops) - 1)
        pos = ops[i]
        end = ops[i + 1]
        kind = rng.randrange(4)
        if kind == 0:  # another opcode, same argument bytes
            yield data[:pos] + bytes([_OPS[rng.randrange(len(_OPS))]]) + data[pos + 1:]
        elif kind == 1:  # an opcode dropped
            yield data[:pos] + data[end:]
        elif kind == 2:  # an opcode repeated
            yield data[:end] + data[pos:end] + data[end:]
        else:  # a hostile global inserted
            yield data[:pos] + _g("posix", "system") + _s("true") + pickle.TUPLE1 + pickle.REDUCE + data[pos:]


class _Hang(BaseException):  # not an Exception: no reader may turn it into a CheckpointError
    pass


def _alarm(signum, frame):
    raise _Hang()


@pytest.fixture
def timm_checkpoint(tmp_path):
    timm = pytest.importorskip("timm")
    path = tmp_path / "timm.pth"
    torch.save(timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, num_classes=0).state_dict(), path)
    return path


def test_fuzzed_checkpoints_load_or_are_refused(runner_checkpoint, timm_checkpoint, tmp_path):
    """Random opcode mutations (seeded, bounded): each is a load, or a CheckpointError; never
    code (the inserted os.system never runs: it would touch nothing, so every result is checked
    not to be a call's), never another exception, never a hang (2 s each)."""
    rng = random.Random(45)
    old = signal.signal(signal.SIGALRM, _alarm)
    outcomes = {"loaded": 0, "refused": 0}
    try:
        for source in (runner_checkpoint, timm_checkpoint):
            data = _data_pkl(source)
            for n, mutant in enumerate(_mutants(data, rng, 40)):
                path = tmp_path / f"m{n}.pth"
                path.write_bytes(source.read_bytes())
                _rewrite(path, mutant)
                signal.alarm(2)
                try:
                    read_checkpoint(str(path))
                    outcomes["loaded"] += 1
                except CheckpointError:
                    outcomes["refused"] += 1
                finally:
                    signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 80, outcomes


def test_torch_force_weights_only_load_is_a_clear_error(tmp_path, monkeypatch):
    """``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` makes torch refuse any unpickler but its own, which has
    none of this loader's bounds (a crafted key crashes it): a load says so, naming the variable,
    on a plain state dict too; code never runs. Older torch has no such variable: read as always."""
    torch.save({"state_dict": OrderedDict(w=torch.arange(3.0))}, tmp_path / "plain.pth")
    marker = tmp_path / "ran"
    torch.save({"x": _Call(os.system, f"touch {marker}")}, tmp_path / "evil.pth")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    import inspect

    if "TORCH_FORCE_WEIGHTS_ONLY_LOAD" in inspect.getsource(torch.serialization):  # (torch >= 2.1)
        with pytest.raises(CheckpointError, match="TORCH_FORCE_WEIGHTS_ONLY_LOAD is set.*unset it"):
            read_checkpoint(str(tmp_path / "plain.pth"))
    else:
        torch.testing.assert_close(read_checkpoint(str(tmp_path / "plain.pth"))["state_dict"]["w"], torch.arange(3.0))
    with pytest.raises(CheckpointError):
        read_checkpoint(str(tmp_path / "evil.pth"))
    assert not marker.exists()
