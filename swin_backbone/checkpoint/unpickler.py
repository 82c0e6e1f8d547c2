"""The one unpickler every torch checkpoint the package reads goes through.

:class:`InertUnpickler` runs a fixed set of pickle opcodes over :mod:`.records`' table:

* a global resolves to a table row (an inert :class:`~.records.Entry`) or a torch dtype, never
  to an object of any library; anything else is refused, naming the global;
* REDUCE / NEWOBJ run the row's handler on validated plain data; BUILD sets state only on
  records and a state dict's ``_metadata``; APPEND / SETITEM / ADDITEMS fill only lists, dicts
  and sets; INST, OBJ, text PERSID, extension codes and out-of-band buffers are refused;
* a persistent id is a storage of the file: the zip record it names exists and is exactly as
  long as the storage, or (old, non-zip files) all storages together fit in the file, checked
  before torch allocates one;
* at most :data:`MAX_OPCODES` opcodes; what they make (an object, a stack, memo or container
  slot, a call's tensor) is charged to the load's budget (:func:`~.records.load_budget`, the one
  :func:`~.records.materialize` spends) as each opcode runs: a fixed cost per opcode, or the size of
  the one string, int or tuple it made; nesting is bounded by :func:`~.records.materialize`.

torch reads the container (zip or legacy), storages and ``map_location`` as always
(``torch.load(pickle_module=...)``); the unpickler inside is this one, on every torch from 2.0.
Nothing is added to torch's own weights-only list: ``import swin_backbone`` changes nothing
another library's ``torch.load`` accepts.
"""
from __future__ import annotations

import collections
import contextlib
import enum
import io
import os
import pickle
import pickletools
import re
import struct
import sys
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..torch_compat import load, zip_record_names
from .records import (ASKS_FOR_CODE, CONSTANTS, ENTRIES, ITEM_BYTES, OPT_IN, RefusedError, brief, build, call,
                      check_key, check_trusted_state, describe, load_budget, load_left, materialize, new, over_budget,
                      refuse, spend, trusted_types)

#: Opcodes one pickle may run: far more than any checkpoint needs (a detector's Runner checkpoint
#: with AdamW state runs about 100 000), few enough that the objects they make stay small.
MAX_OPCODES = 4_000_000
#: Bytes a REDUCE / NEWOBJ or a persistent id is charged for what it makes beside what its row
#: spends itself: a tensor (its Python object and TensorImpl, about 560 bytes), a storage.
CALL_BYTES = 640
#: Records a torch zip archive may hold: one per storage, and a few (a detector's Runner
#: checkpoint with AdamW state holds about 1000); each costs a zip reader a kilobyte or more.
MAX_ZIP_RECORDS = 1 << 16

_LOCATION = re.compile(r"[a-z_]{1,16}(:\d{1,4})?")
_KEY = re.compile(r"[0-9A-Za-z_.-]{1,64}")


class _Storages:
    """What the storages of one file may be: the zip's records (name -> size), or for a
    legacy file a byte budget (the file's size) shared by every storage."""

    def __init__(self, records: Optional[Dict[str, int]] = None, budget: int = 0) -> None:
        self.records, self.budget = records, budget
        self.seen: Dict[str, int] = {}
        #: what the last module-level load returned (a legacy file's last: the keys of the storages
        #: its tail fills)
        self.last_load: Any = None

    def check_filled(self) -> None:
        """A legacy file fills every storage its pickle declared (torch allocates them
        uninitialised and fills those the keys after the pickle name)."""
        if self.records is None and self.seen:
            keys = self.last_load
            if type(keys) is not list or not set(self.seen) <= {k for k in keys if type(k) is str}:
                raise refuse("the file declares storages its data does not fill (they would hold uninitialised "
                             "memory)")

    def check(self, pid: Any) -> None:
        if type(pid) is not tuple or not pid or pid[0] != "storage":
            raise refuse(f"persistent id {describe(pid)}: only storages of the file are read")
        legacy = self.records is None
        if len(pid) != (6 if legacy else 5):
            raise refuse(f"storage id of {len(pid)} fields, expected {6 if legacy else 5}")
        storage_type, key, location, numel = pid[1:5]
        if type(storage_type) is not torch.serialization.StorageType and storage_type is not torch.UntypedStorage:
            raise refuse(f"storage type {describe(storage_type)}: not a torch storage type")
        if type(key) is not str or not _KEY.fullmatch(key):
            raise refuse(f"storage key {brief(key)}: expected a short name")
        if type(location) is not str or not _LOCATION.fullmatch(location):
            raise refuse(f"storage location {brief(location)}: expected a device such as 'cpu' or 'cuda:0'")
        if location.split(":")[0] == "meta":  # (torch.save never writes one: read without map_location, the
            # file's tensors would hold no values, and a model loaded from them would keep none)
            raise refuse(f"storage location {location!r}: a storage of the file holds data, on a device such as "
                         "'cpu' or 'cuda:0'; 'meta' holds none")
        if type(numel) is not int or numel < 0:
            raise refuse(f"storage size {brief(numel)}: expected an int >= 0")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * torch._utils._element_size(dtype)
        if not legacy:
            have = self.records.get(f"data/{key}")
            if have is None or have != nbytes:
                raise refuse(f"storage {key!r}: {brief(nbytes)} bytes asked, the archive's record data/{key} has "
                             f"{'none' if have is None else have}")
            return
        if key not in self.seen:
            if nbytes > self.budget:
                raise refuse(f"storage {key!r}: {brief(nbytes)} bytes asked, more than the file's remaining "
                             f"{self.budget} bytes can hold")
            self.budget -= nbytes
            self.seen[key] = numel
        elif self.seen[key] != numel:
            raise refuse(f"storage {key!r} named with two sizes")
        view = pid[5]
        if view is not None:
            if type(view) is not tuple or len(view) != 3 or type(view[0]) is not str \
                    or not all(type(n) is int and n >= 0 for n in view[1:]) or view[1] + view[2] > numel:
                raise refuse(f"storage view {describe(view)}: expected (key, offset, size) within {brief(numel)} "
                             "elements")


class InertUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's own unpickler with only the opcodes listed here; globals, calls, state and
    persistent ids go through :mod:`.records`' table (module docstring)."""

    #: set per load (:func:`pickle_module`)
    storages: Optional[_Storages] = None
    #: name -> real object, for one load's own classes only (FSDP's sharded tensors), called as
    #: Python's unpickler would; empty otherwise
    trusted: Dict[str, Any] = {}

    def __init__(self, file: Any, **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._input = file  # (its size bounds a load outside read_torch_checkpoint: load)

    def _is_trusted(self, obj: Any) -> bool:
        return bool(self.trusted) and any(obj is value for value in self.trusted.values())

    # A load's own classes (trusted) are made only as their writer pickles them: functions (the
    # caller's checked rebuilds) called, an Enum called with one of its values, a class created
    # without arguments and given its state once, the state checked (check_trusted_state).
    def _call_trusted(self, func: Any, args: Any) -> Any:
        if isinstance(func, type):
            if not (issubclass(func, enum.Enum) and type(args) is tuple and len(args) == 1
                    and type(args[0]) in (int, str) and args[0] in {m.value for m in func}):
                raise refuse(f"{describe(func)}: called with {brief(args)}; only an Enum with one of its values")
            return func(args[0])
        return func(*args)

    def _new_trusted(self, cls: Any, args: Any, kwargs: Any = None) -> Any:
        if not isinstance(cls, type) or issubclass(cls, enum.Enum) or args != () or kwargs not in (None, {}):
            raise refuse(f"{describe(cls)}: created with {brief(args)}; expected no arguments")
        obj = cls.__new__(cls)
        self._unbuilt[id(obj)] = obj
        return obj

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # protocol 2 writes Python 2 names (__builtin__.getattr)
            import _compat_pickle

            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        key = f"{module}.{name}"
        if key in self.trusted:
            return self.trusted[key]
        found = ENTRIES.get(key, CONSTANTS.get(key))
        if found is None:
            raise refuse(f"{ASKS_FOR_CODE}: GLOBAL {key[:200]} is not in the table of data this loader reads; it was "
                         f"refused, nothing in it ran. {OPT_IN}")
        return found

    def load(self) -> Any:
        """Python's loop (``pickle._Unpickler.load``), with :attr:`dispatch` holding only the
        allowed opcodes, at most :data:`MAX_OPCODES` of them, each charged what it makes
        (:data:`_STEPS`) to the load's budget; outside a load (:func:`~.records.load_budget`), to one
        of its own, for what is left of its input."""
        if not hasattr(self, "_file_read"):
            raise pickle.UnpicklingError("Unpickler.__init__() was not called")
        if load_left() is None:
            with load_budget(_bytes_left(self._input)):
                return self._load()
        return self._load()

    def _load(self) -> Any:
        self._unbuilt: Dict[int, Any] = {}  # trusted instances made by NEWOBJ, not yet given their state
        self._trusted_types = trusted_types(self.trusted)
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        self._budget = budget = load_left()
        read, steps = self.read, _STEPS
        left, key, credit = MAX_OPCODES, b"", 0
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                step = steps.get(key[0])
                if step is None:
                    raise refuse(f"pickle opcode {key!r} ({_OPCODE_NAMES.get(key[0], 'unknown')}) is not read "
                                 "(it names code or objects outside the table)")
                left -= 1
                if left < 0:
                    raise refuse(f"more than {MAX_OPCODES} pickle opcodes")
                op, cost = step
                credit -= cost  # (records.spend's rule, taken a block at a time: it runs once per opcode)
                if credit < 0:
                    credit = _reserve(budget, credit, cost, key[0])
                op(self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value
        except RefusedError:
            raise
        except Exception as err:  # a malformed pickle: an empty stack, an unhashable key, a bad memo index ...
            where = f"opcode {_OPCODE_NAMES.get(key[0], key)!s}" if key else "its end"
            raise refuse(f"a malformed pickle ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
                         f" at {where} after {MAX_OPCODES - left} opcodes)") from None
        finally:
            budget[0] += max(credit, 0)  # (taken for the opcodes, not made)

    # -- calls and state: the table decides
    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        self.stack[-1] = self._call_trusted(func, args) if self._is_trusted(func) else call(func, args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new_trusted(cls, args) if self._is_trusted(cls) else new(cls, args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new_trusted(cls, args, kwargs) if self._is_trusted(cls) else new(cls, args, kwargs))

    def load_build(self) -> None:
        if self._is_trusted(type(self.stack[-2])):
            inst = self.stack[-2]
            if self._unbuilt.pop(id(inst), None) is not inst:  # (an Enum member, or one given its state already)
                raise refuse(f"the file asks to set the state of {describe(inst)} again, or of one it did not create")
            check_trusted_state(self.stack[-1], self._trusted_types, f"the state of {describe(inst)}")
            super().load_build()
            return
        state = self.stack.pop()
        build(self.stack[-1], state)

    def load_binpersid(self) -> None:
        pid = self.stack.pop()
        if self.storages is None or "persistent_load" not in vars(self):
            raise refuse(f"persistent id {describe(pid)} outside a torch checkpoint's pickle")
        self.storages.check(pid)
        self.append(self.persistent_load(pid))

    # -- containers: only lists, dicts and sets are filled
    def _target(self, kinds: tuple, obj: Any, what: str) -> Any:
        if type(obj) not in kinds:
            raise refuse(f"{what} into {describe(obj)}: only lists, dicts and sets are filled")
        return obj

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target((list,), self.stack[-1], "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        target = self._target((list,), self.stack[-1], "APPENDS")
        spend(_LIST_SLOT * len(items), "the pickle's list items (APPENDS)")
        target.extend(items)

    # (every key is checked before it is hashed: check_key)
    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self._target(_DICTS, self.stack[-1], "SETITEM")
        check_key(key, "SETITEM")
        target[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target(_DICTS, self.stack[-1], "SETITEMS")
        spend(ITEM_BYTES * (len(items) // 2), "the pickle's dict items (SETITEMS)")
        for i in range(0, len(items) - 1, 2):
            check_key(items[i], "SETITEMS")
            target[items[i]] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        for key in items[::2]:
            check_key(key, "DICT")
        spend(_size({}) + ITEM_BYTES * (len(items) // 2), "the pickle's dicts (DICT)")
        self.append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        for item in items:
            check_key(item, "FROZENSET")
        spend(_size(frozenset()) + ITEM_BYTES * len(items), "the pickle's sets (FROZENSET)")
        self.append(frozenset(items))

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self._target((set,), self.stack[-1], "ADDITEMS")
        for item in items:
            check_key(item, "a set")
        spend(ITEM_BYTES * len(items), "the pickle's set items (ADDITEMS)")
        target.update(items)

    def load_tuple(self) -> None:
        items = self.pop_mark()
        spend(_object(_EMPTY_TUPLE + _REF * len(items)) + _REF, "the pickle's tuples (TUPLE)")
        self.append(tuple(items))


_DICTS = (dict, collections.OrderedDict, collections.Counter, collections.defaultdict)
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}

#: Python's data opcodes, as Python's unpickler runs them: they push numbers, strings, bytes,
#: containers and memo references, and call nothing. (Not BYTEARRAY8: Python's unpickler
#: allocates the length it declares before reading; nor the text PUT / GET, whose memo index is
#: any int, so that indices can share a hash: torch.save writes neither.)
_DATA_OPCODES = ("PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE", "INT",
                 "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING",
                 "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "UNICODE",
                 "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
                 "EMPTY_LIST", "LIST", "EMPTY_DICT", "EMPTY_SET", "BINGET", "LONG_BINGET",
                 "BINPUT", "LONG_BINPUT", "MEMOIZE", "GLOBAL", "STACK_GLOBAL")
_REF = struct.calcsize("P")  # a slot of the stack, a list or a tuple
_EMPTY_TUPLE = sys.getsizeof(())


def _object(nbytes: int) -> int:
    """What an object of ``nbytes`` (``sys.getsizeof``) takes: Python's allocator rounds to 16 bytes."""
    return -(-nbytes // 16) * 16


def _size(obj: Any) -> int:
    """What ``obj`` pushed takes: itself and its stack slot."""
    return _object(sys.getsizeof(obj)) + _REF


#: A list's slot, with its over-allocation and the copy a resize makes.
_LIST_SLOT = 2 * _REF

#: opcode name -> (bytes charged before it runs, what it makes): what each pushes (a slot; the
#: object it makes where that has a fixed size), the list a MARK starts, a container's or the memo's
#: new slot, what a call makes. Opcodes that make objects of a size they read (strings, bytes, long
#: ints; tuples, dicts and container items of a mark's items) are charged by their handlers
#: (:func:`_charged`, ``load_tuple``, ``load_appends`` ...); tensors' storages are not charged here
#: (their bytes are the file's: :class:`_Storages`, and materialize spends them).
_FIXED: Dict[str, Tuple[int, str]] = {
    **{name: (_REF, "stack") for name in ("DUP", "NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "BININT1", "BINGET",
                                          "LONG_BINGET", "GLOBAL", "STACK_GLOBAL", "LIST")},
    "MARK": (_size([]), "marks"),  # (its list, and its slot in the metastack)
    "BININT": (_size(1 << 31), "ints"), "BININT2": (_size(1 << 31), "ints"),
    "BINFLOAT": (_size(0.0), "floats"), "FLOAT": (_size(0.0), "floats"),
    "EMPTY_LIST": (_size([]), "lists"), "EMPTY_DICT": (_size({}), "dicts"), "EMPTY_SET": (_size(set()), "sets"),
    "TUPLE1": (_size((0,)), "tuples"), "TUPLE2": (_size((0, 0)), "tuples"), "TUPLE3": (_size((0, 0, 0)), "tuples"),
    # (BINPUT's one-byte indices name at most 256 entries: it never grows the memo further)
    **{name: (ITEM_BYTES, "memo") for name in ("LONG_BINPUT", "MEMOIZE")},
    "APPEND": (_LIST_SLOT, "list items"), "SETITEM": (ITEM_BYTES, "dict items"),
    **{name: (CALL_BYTES, "call results") for name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX")},
    "BINPERSID": (CALL_BYTES, "storages"),
}
#: Opcodes that make one object of a size read from the file, charged by that size once made
#: (an object at most a few times the bytes it read): opcode -> what it makes.
_SIZED = {**{name: "ints" for name in ("INT", "LONG", "LONG1", "LONG4")},
          **{name: "strings" for name in ("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
                                          "BINUNICODE", "BINUNICODE8")},
          **{name: "bytes" for name in ("BINBYTES", "SHORT_BINBYTES", "BINBYTES8")}}


#: Bytes the loop takes from the load's budget at a time for its opcodes' fixed costs (what a
#: handler spends meanwhile finds the budget at most this much lower).
_BLOCK = 1 << 16


def _reserve(budget: List[int], credit: int, cost: int, code: int) -> int:
    """The loop's ``credit`` (below 0 after an opcode's ``cost``) made good from the load's budget,
    with a block more; or :func:`~.records.spend`'s refusal where the budget cannot."""
    take = min(budget[0], _BLOCK - credit)
    if take < -credit:
        raise over_budget(cost, _WHAT[code])
    budget[0] -= take
    return credit + take


def _charged(load: Callable[[Any], None], what: str) -> Callable[[Any], None]:
    """Python's handler ``load``, then the object it pushed charged by its size (:func:`_size`)."""
    def charged(self: Any, getsizeof: Callable[[Any], int] = sys.getsizeof) -> None:
        load(self)
        nbytes = -(-getsizeof(self.stack[-1]) // 16) * 16 + _REF  # (_size, inline: strings are many)
        budget = self._budget
        if nbytes > budget[0]:
            raise over_budget(nbytes, what)
        budget[0] -= nbytes

    return charged


_OURS = {"REDUCE": InertUnpickler.load_reduce, "NEWOBJ": InertUnpickler.load_newobj,
         "NEWOBJ_EX": InertUnpickler.load_newobj_ex, "BUILD": InertUnpickler.load_build,
         "BINPERSID": InertUnpickler.load_binpersid, "APPEND": InertUnpickler.load_append,
         "APPENDS": InertUnpickler.load_appends, "SETITEM": InertUnpickler.load_setitem,
         "SETITEMS": InertUnpickler.load_setitems, "ADDITEMS": InertUnpickler.load_additems,
         "DICT": InertUnpickler.load_dict, "FROZENSET": InertUnpickler.load_frozenset,
         "TUPLE": InertUnpickler.load_tuple,
         **{name: _charged(pickle._Unpickler.dispatch[getattr(pickle, name)[0]],  # type: ignore[attr-defined]
                           f"the pickle's {what} ({name})") for name, what in _SIZED.items()}}
InertUnpickler.dispatch = {
    **{getattr(pickle, name)[0]: pickle._Unpickler.dispatch[getattr(pickle, name)[0]]  # type: ignore[attr-defined]
       for name in _DATA_OPCODES},
    **{getattr(pickle, name)[0]: fn for name, fn in _OURS.items()},
}
#: opcode -> (its handler, the bytes charged as it runs: :data:`_FIXED`; 0: none, or charged by
#: its handler), and what the refusal names.
_STEPS = {code: (op, _FIXED.get(_OPCODE_NAMES[code], (0, ""))[0]) for code, op in InertUnpickler.dispatch.items()}
_WHAT = {code: f"the pickle's {_FIXED[name][1]} ({name})" for code in InertUnpickler.dispatch
         if (name := _OPCODE_NAMES[code]) in _FIXED}


def pickle_module(storages: _Storages, trusted: Optional[Dict[str, Any]] = None) -> type:
    """A ``pickle_module`` for ``torch.load`` whose unpickler is :class:`InertUnpickler` checking
    ``storages`` (and calling ``trusted``'s objects)."""
    unpickler = type("Unpickler", (InertUnpickler,), dict(storages=storages, trusted=dict(trusted or {})))

    def load_(file: Any, **kwargs: Any) -> Any:
        storages.last_load = unpickler(file, **kwargs).load()
        return storages.last_load

    def loads(data: bytes, **kwargs: Any) -> Any:
        return unpickler(io.BytesIO(data), **kwargs).load()

    return type("swin_backbone_inert_pickle", (), dict(Unpickler=unpickler, UnpicklingError=pickle.UnpicklingError,
                                                       load=staticmethod(load_), loads=staticmethod(loads)))


def _bytes_left(file: Any) -> int:
    """What is left to read of ``file`` (0 where it cannot tell)."""
    try:
        here = file.tell()
        end = file.seek(0, io.SEEK_END)
        file.seek(here)
    except (AttributeError, OSError, ValueError):
        return 0
    return max(end - here, 0) if type(here) is int and type(end) is int else 0


def zip_records(path: str) -> Dict[str, int]:
    """``name -> size`` of a torch zip archive's records (names without the archive's folder),
    from its central directory (nothing is decompressed). Refuses an archive that Python's
    ``zipfile`` and torch's reader would read differently (the central directory's place and
    count, the record names), a TorchScript archive (``torch.load`` would hand it to
    ``torch.jit.load``), two records of one name, records outside one folder, or a compressed
    record (torch never writes one)."""
    with open(path, "rb") as f:
        end = zipfile._EndRecData(f)  # type: ignore[attr-defined]  (the end record, as zipfile reads it)
        listed = 0 if end is None else _directory_entries(f, end)
    if end is not None and end[zipfile._ECD_ENTRIES_TOTAL] > MAX_ZIP_RECORDS:  # type: ignore[attr-defined]
        raise refuse(f"the archive declares {end[zipfile._ECD_ENTRIES_TOTAL]} records, more than the "  # type: ignore[attr-defined]
                     f"{MAX_ZIP_RECORDS} a checkpoint's storages need (zip readers hold each in memory)")
    if listed > MAX_ZIP_RECORDS:
        raise refuse(f"the archive's central directory holds more than {MAX_ZIP_RECORDS} records (its end record "
                     f"declares {end[zipfile._ECD_ENTRIES_TOTAL]}), more than a checkpoint's storages need (zip "  # type: ignore[index]
                     "readers hold each in memory)")
    with zipfile.ZipFile(path) as archive:
        infos, start = archive.infolist(), archive.start_dir
    # Python finds the central directory at (end record - its size), torch's miniz at the offset
    # the end record names: where they differ (or the counts do), the two readers see two archives.
    if end is None or start != end[zipfile._ECD_OFFSET] or end[zipfile._ECD_ENTRIES_TOTAL] != len(infos):  # type: ignore[attr-defined]
        raise refuse("the archive's central directory is not where its end record says, or holds another number "
                     "of records: two zip readers would read two different archives")
    records: Dict[str, int] = {}
    folders = set()
    for info in infos:
        folder, _, name = info.filename.partition("/")
        folders.add(folder)
        if name in records:
            raise refuse(f"the archive holds two records named {info.filename!r:.80}")
        records[name] = info.file_size
    if len(folders) > 1:
        raise refuse(f"the archive's records lie in {len(folders)} folders; torch.save writes one")
    torch_names = zip_record_names(path)  # what torch.load itself will read
    if sorted(torch_names) != sorted(records):
        raise refuse("torch's zip reader lists other records than Python's: two zip readers would read two "
                     "different archives")
    if "constants.pkl" in records or any(n.startswith("code/") for n in records):
        raise refuse("a TorchScript archive (torch.jit.save): it holds code; load it with torch.jit.load if you "
                     "trust it, or save the model's state_dict() with torch.save")
    packed = next((info for info in infos if info.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:  # torch.save stores; a compressed record is a zip bomb's shape
        raise refuse(f"the archive's record {packed.filename!r:.80} is compressed ({packed.file_size} bytes from "
                     f"{packed.compress_size}); torch.save stores its records uncompressed")
    return records


def _directory_entries(f: Any, end: list) -> int:
    """The entries of the central directory as Python's ``zipfile`` will list them, counted up to
    :data:`MAX_ZIP_RECORDS` + 1 without making any: it walks the directory by its size in bytes,
    not by the count the end record declares (torch's reader uses the count)."""
    start = end[zipfile._ECD_LOCATION] - end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]  (as zipfile finds it)
    if end[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:  # type: ignore[attr-defined]
        start -= zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator  # type: ignore[attr-defined]
    f.seek(max(start, 0))
    data = f.read(end[zipfile._ECD_SIZE])  # type: ignore[attr-defined]  (zipfile reads it whole too)
    count, at, header = 0, 0, zipfile.sizeCentralDir  # type: ignore[attr-defined]
    while at + header <= len(data) and count <= MAX_ZIP_RECORDS:
        name, extra, comment = struct.unpack_from("<HHH", data, at + 28)
        at += header + name + extra + comment
        count += 1
    return count


class _PythonReads(io.FileIO):
    """A file torch reads through Python calls (no ``fileno``): torch then never tries the
    pre-1.0 tar format on it, whose reader allocates what the file declares. A read asks for
    at most what is left of the file (``FileIO.read(n)`` allocates ``n`` bytes first)."""

    def fileno(self) -> int:  # noqa: D102
        raise io.UnsupportedOperation("read through Python")

    def read(self, size: int = -1) -> bytes:  # noqa: D102
        left = max(os.fstat(super().fileno()).st_size - self.tell(), 0)
        return super().read(left if size is None or size < 0 else min(size, left))

    def readline(self, size: int = -1) -> bytes:  # noqa: D102
        # In blocks (io's readline reads a byte per call without peek): a line of the pickle's
        # text opcodes, at most the rest of the file.
        start, line, limit = self.tell(), bytearray(), -1 if size is None else size
        while limit < 0 or len(line) < limit:
            block = self.read(1 << 16 if limit < 0 else min(1 << 16, limit - len(line)))
            end = block.find(b"\n")
            line += block if end < 0 else block[:end + 1]
            if end >= 0 or not block:
                break
        self.seek(start + len(line))
        return bytes(line)


def read_torch_checkpoint(path: str, kind: str, map_location: Union[str, torch.device, Any] = "cpu",
                          trusted: Optional[Dict[str, Any]] = None) -> Any:
    """What the torch file at ``path`` (``kind``: ``'torch-zip'`` or ``'torch-pickle'``, from
    :func:`~.files.sniff`) holds, unpickled by :class:`InertUnpickler` and made real by
    :func:`~.records.materialize`. Raises :class:`~.records.RefusedError` for what the table
    refuses; torch's own errors for a damaged container.

    ``trusted`` (``{'module.name': object}``): objects this one load calls and creates as
    Python's unpickler would, beside the table; only for files whose writer the caller knows
    (the FSDP strategy's own shards, :mod:`swin_backbone.mmlab.fsdp`), never for a user's file."""
    legacy, size = kind != "torch-zip", os.path.getsize(path)
    storages = _Storages(budget=size) if legacy else _Storages(records=zip_records(path))
    with load_budget(size):  # (what the records make, through materialize)
        with _PythonReads(path, "r") if legacy else contextlib.nullcontext(path) as source:
            try:
                obj = load(source, map_location, pickle_module=pickle_module(storages, trusted))
            except RuntimeError as err:
                if "explicit pickle_module" not in str(err):
                    raise
                # (torch's own unpickler has none of this loader's bounds: a crafted file crashes it)
                raise refuse("TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, so torch reads only through its own "
                             "unpickler, without this loader's checks and bounds; unset it for this process (this "
                             "loader reads weights only, on every torch)") from None
        storages.check_filled()
        if isinstance(obj, torch.jit.ScriptModule):  # (never: the archive checks above refuse TorchScript)
            ran = RefusedError("a TorchScript archive: torch.load handed it to torch.jit.load, which ran its code")
            ran.ran_nothing = False
            raise ran
        return materialize(obj, trusted_types(trusted))

__all__ = ["ASKS_FOR_CODE", "InertUnpickler", "MAX_OPCODES", "OPT_IN", "RefusedError", "read_torch_checkpoint"]
