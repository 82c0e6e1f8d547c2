"""What a checkpoint's pickle may name, and the inert records it is read into.

A pickle is a program: each global it names is called, and BUILD hands state to what it built.
:mod:`.unpickler` therefore never resolves a name to a class or a function of any library.
Every global a checkpoint may name is a row of :data:`TABLE`, and the stack sees only

* plain data: ``None``, bools, numbers, strings, bytes, and ``list`` / ``tuple`` / ``dict`` /
  ``set`` / ``frozenset`` / ``OrderedDict`` / ``Counter`` / ``defaultdict`` of those;
* torch's tensors, storages, ``torch.Size``, ``torch.device`` and dtypes, built by torch's own
  functions from validated arguments;
* records of this module: classes with ``__slots__`` and no methods. An :class:`Entry` stands
  for a table row (what ``GLOBAL`` pushes): it cannot be called, only named. The getattr row
  yields a :class:`MethodName`, a name; never a function.

REDUCE / NEWOBJ on an entry run that row's handler here, which accepts validated plain data
only. BUILD sets state only on records, by one handler per record type, and on an
``OrderedDict`` (torch's ``_metadata``). After unpickling, :func:`materialize` makes the real
objects (numpy arrays and scalars, mmengine's ``HistoryBuffer`` and ``ConfigDict``) through
their public constructors from validated numbers and bytes; a numpy array is always
``np.frombuffer`` of size-checked bytes, for a fixed list of numeric dtypes.

The rows are what real checkpoints name (``pickletools`` on what torch, timm, torchvision,
Hugging Face, mmengine's Runner and older mmengine / mmcv write; tests/checkpoint/
test_inert_loading.py disassembles them): docs/checkpoints.md, "Security model".
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import math
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from .base import CheckpointError

#: Containers nest at most this deep (a Runner checkpoint nests about 6 levels).
MAX_DEPTH = 32
#: Dimensions a tensor or an array may have.
MAX_DIMS = 32
#: A tensor may view at most this many times its storage's elements (stride-0 broadcasts), so
#: that a view of one element cannot stand for terabytes once copied.
MAX_VIEW_RATIO = 64
#: Objects the data may hold counted along every path (shared parts once per place they hang):
#: what a consumer that copies without a memo walks (mmengine's ``ConfigDict``, torch's optimizer
#: ``_cast``). A Runner checkpoint holds a few thousand.
MAX_EXPANDED = 1 << 20
#: The same count for a ``ConfigDict``'s items, which it copies into a ConfigDict per dict along
#: every path (hundreds of bytes each): a config holds hundreds of objects.
MAX_CONFIG_EXPANDED = 1 << 16
#: Bytes the records of one load may make (bytes from strings, numpy arrays' copies) and the
#: objects its pickle makes (:mod:`.unpickler`), per byte of the file: what a file writes once it
#: cannot have made many times over.
BYTES_PER_FILE_BYTE = 4
#: Bytes any load may make beside that, for files with little tensor data: the unpickler charges
#: about 3 KB of objects per tensor (a file of 5000 scalar tensors: 16 MB).
LOAD_ALLOWANCE = 16 << 20
#: A dict key that is an int lies within this bound: below it an int is its own hash, so keys
#: cannot be chosen to collide (``k * (2**61 - 1)`` all hash to 0: quadratic dict inserts).
MAX_KEY_INT = (1 << 61) - 2
#: A size (a tensor's, an array's) lies below this bound.
MAX_SIZE = 1 << 63
#: A tuple key has at most this many parts; a string or bytes key part at most this many characters.
MAX_KEY_PARTS, MAX_KEY_CHARS = 8, 4096
#: A tuple key's int parts lie below this bound, and a load inserts at most this many tuple keys:
#: CPython's tuple hash can be solved for its parts, so keys can be made to share one hash (each
#: insert then probes every key before it); strings and bytes hash with a per-process key.
MAX_KEY_PART_INT, MAX_TUPLE_KEYS = 1 << 32, 4096
#: Bytes a copied container is charged per item (a dict's or set's slot and entry).
ITEM_BYTES = 100


#: What the message of a file that names or calls code says first (tests and callers match it).
ASKS_FOR_CODE = "the file asks to run code"
#: How a user who trusts a refused file reads it anyway: an explicit step of their own.
OPT_IN = ("If you trust this file and its source, read it yourself with torch.load(path, weights_only=False) "
          "and pass the dict to swin_backbone.load_checkpoint(model, checkpoint), or re-save its tensors with "
          "torch.save(state_dict) (docs/checkpoints.md, \"Security model\")")


class RefusedError(CheckpointError):
    """A checkpoint asked for something the table does not allow (the message says what).
    Nothing in the file ran (``ran_nothing``)."""

    ran_nothing = True


def refuse(what: str) -> RefusedError:
    return RefusedError(what)


#: What the load in progress may still make: ``[bytes, tuple keys]`` (``None``: no load, no bound).
_LEFT: contextvars.ContextVar[Optional[List[int]]] = contextvars.ContextVar("swin_backbone_load_left", default=None)


@contextlib.contextmanager
def load_budget(file_bytes: int) -> Iterator[None]:
    """Bound what the records of one load make to :data:`BYTES_PER_FILE_BYTE` times ``file_bytes``
    plus :data:`LOAD_ALLOWANCE` (each maker asks :func:`spend` before it allocates; the unpickler
    charges each object its opcodes make), and the tuple keys it inserts to :data:`MAX_TUPLE_KEYS`."""
    token = _LEFT.set([BYTES_PER_FILE_BYTE * file_bytes + LOAD_ALLOWANCE, MAX_TUPLE_KEYS])
    try:
        yield
    finally:
        _LEFT.reset(token)


def spend(nbytes: int, what: str) -> None:
    """Take ``nbytes`` from the load's :func:`load_budget`, or refuse before they are allocated."""
    left = _LEFT.get()
    if left is not None:
        if nbytes > left[0]:
            raise over_budget(nbytes, what)
        left[0] -= nbytes


def load_left() -> Optional[List[int]]:
    """What the load in progress may still make (``[bytes, tuple keys]``, :func:`load_budget`), or
    ``None`` outside a load: for a maker that takes from it as :func:`spend` does, once per opcode
    (the unpickler)."""
    return _LEFT.get()


def over_budget(nbytes: int, what: str) -> RefusedError:
    """:func:`spend`'s refusal: ``what`` would take ``nbytes`` more than the load has left."""
    return refuse(f"{what}: {nbytes} more bytes would pass what this load may make "
                  f"({BYTES_PER_FILE_BYTE} times the file's size): a small file that unpacks into much more")


# ---------------------------------------------------------------------------- records
class Record:
    """Base of the records: slots only, no behaviour (identity equality and hash)."""

    __slots__ = ()


class Entry(Record):
    """A table row as the stack sees it: ``GLOBAL module name`` pushes this, never the object
    the name denotes."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class MethodName(Record):
    """``getattr(HistoryBuffer, 'min')`` as mmengine pickles a statistic: the name only."""

    __slots__ = ("owner", "name")

    def __init__(self, owner: str, name: str) -> None:
        self.owner, self.name = owner, name


class DtypeRecord(Record):
    """``numpy.dtype(name)``: a name from :data:`NUMPY_DTYPES`; ``built`` once its BUILD state
    was checked against the canonical state of that dtype."""

    __slots__ = ("name", "built")

    def __init__(self, name: str) -> None:
        self.name, self.built = name, False


class ArrayRecord(Record):
    """``numpy.ndarray``: filled by its BUILD with a dtype, a shape and exactly the bytes they need."""

    __slots__ = ("dtype", "shape", "fortran", "data")

    def __init__(self) -> None:
        self.dtype, self.shape, self.fortran, self.data = None, None, False, None


class ScalarRecord(Record):
    """``numpy`` scalar: a dtype and its ``itemsize`` bytes."""

    __slots__ = ("dtype", "data")

    def __init__(self, dtype: str, data: bytes) -> None:
        self.dtype, self.data = dtype, data


class HistoryBufferRecord(Record):
    """mmengine's ``HistoryBuffer``: its histories and ``max_length``, set by its BUILD."""

    __slots__ = ("log", "count", "max_length")

    def __init__(self) -> None:
        self.log, self.count, self.max_length = None, None, None


class MessageHubRecord(Record):
    """An old mmengine ``MessageHub`` saved whole: its three tables, set by its BUILD."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = None


class ConfigDictRecord(Record):
    """mmengine's ``ConfigDict``: its items (plain data)."""

    __slots__ = ("items",)

    def __init__(self, items: dict) -> None:
        self.items = items


# ---------------------------------------------------------------------------- plain data
#: Leaf types of plain data (exact types: no subclass with behaviour of its own).
PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.dtype, torch.device)
#: Containers of plain data.
CONTAINERS = (list, tuple, dict, set, frozenset, collections.OrderedDict, collections.Counter,
              collections.defaultdict)
#: Records that may sit in plain data (and are made real by :func:`materialize`).
DATA_RECORDS = (ArrayRecord, ScalarRecord, HistoryBufferRecord, MessageHubRecord, ConfigDictRecord)


def is_tensor(value: Any) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter)


#: What :func:`check_plain` says it expected, by default.
PLAIN_EXPECTED = "plain data (numbers, strings, bytes, tensors, lists / tuples / dicts of those)"


def check_plain(value: Any, what: str, depth: int = 0, records: Tuple[type, ...] = DATA_RECORDS,
                seen: Optional[set] = None, dunder_keys: bool = True, containers: Tuple[type, ...] = CONTAINERS,
                expected: str = PLAIN_EXPECTED) -> None:
    """Refuse ``value`` unless it is plain data (module docstring), ``records`` (exact types)
    allowed in it, in ``containers``, nested at most :data:`MAX_DEPTH` deep. Keys of dicts:
    :func:`check_key` (no ``__x__`` string unless ``dunder_keys``). Each container is looked at
    once (``seen``): shared parts cost nothing more."""
    kind = type(value)
    if kind in PLAIN_LEAVES or is_tensor(value) or kind in records:
        if kind in (ArrayRecord, DtypeRecord) and not _complete(value):
            raise refuse(f"{what}: a numpy {'array' if kind is ArrayRecord else 'dtype'} without its state")
        return
    if kind not in containers:
        raise refuse(f"{what}: expected {expected}, found {describe(value)}")
    if depth >= MAX_DEPTH:
        raise refuse(f"{what}: data nested deeper than {MAX_DEPTH} levels")
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for key, item in value.items():
            check_key(key, what, inserted=False)
            if not dunder_keys and type(key) is str and key.startswith("__") and key.endswith("__"):
                raise refuse(f"{what}: the key {brief(key)} names an attribute protocol, not data")
            check_plain(item, what, depth + 1, records, seen, dunder_keys, containers, expected)
    else:
        for item in value:
            check_plain(item, what, depth + 1, records, seen, dunder_keys, containers, expected)


#: What a dict key or set item may be (a tuple key's parts: strings, bytes and ints >= 0 only).
_KEY_LEAVES = (str, bytes, bool, type(None), int, float, torch.dtype, torch.device)


def trusted_types(trusted: Optional[Dict[str, Any]]) -> Tuple[type, ...]:
    """The classes among a load's own objects (``trusted``: name -> object)."""
    return tuple(v for v in (trusted or {}).values() if isinstance(v, type))


def check_trusted_state(value: Any, trusted: Tuple[type, ...], what: str) -> None:
    """Refuse ``value`` unless it is what a load's own (trusted) classes hold (:func:`check_plain`
    with other leaves): plain data, tensors, torch layouts and memory formats, instances of
    ``trusted`` and the process group, in lists, tuples and dicts, no ``__x__`` key. (Trusted
    instances are checked when given their state and again by :func:`materialize`, through their
    attributes.)"""
    import torch.distributed as dist

    leaves = (*trusted, torch.layout, torch.memory_format, *((dist.ProcessGroup,) if dist.is_available() else ()))
    check_plain(value, what, records=leaves, dunder_keys=False, containers=(list, tuple, dict, collections.OrderedDict),
                expected="data of the load's own classes")


def check_key(key: Any, what: str, inserted: bool = True) -> None:
    """A dict key or set item, before anything hashes it: a string, bytes, a number or None, or a
    short tuple of strings, bytes and ints in ``[0, 2**32)`` (a nested tuple's hash recurses without
    a limit: a deep one crashes the process). Keys cannot be chosen to share one hash (quadratic
    inserts): an int lies within :data:`MAX_KEY_INT` (below it an int is its own hash), no complex
    number, no tuple part that hashes as another (-1 and -2, True and 1), at most
    :data:`MAX_TUPLE_KEYS` tuple keys ``inserted`` per load (``False``: one checked again), and a
    key is short (:data:`MAX_KEY_CHARS`: messages and key checks copy keys)."""
    if type(key) is tuple:
        ok = len(key) <= MAX_KEY_PARTS and all(
            type(p) in (str, bytes) or (type(p) is int and 0 <= p < MAX_KEY_PART_INT) for p in key)
        left = _LEFT.get()
        if ok and inserted and left is not None:
            if left[1] == 0:
                raise refuse(f"{what}: more than {MAX_TUPLE_KEYS} tuple keys in one load (a checkpoint holds few)")
            left[1] -= 1
    else:
        ok = type(key) in _KEY_LEAVES and not (type(key) is int and abs(key) > MAX_KEY_INT)
    if not ok or any(type(p) in (str, bytes) and len(p) > MAX_KEY_CHARS for p in (key if type(key) is tuple else (key,))):
        raise refuse(f"{what}: a dict key or set item must be a string or bytes (at most {MAX_KEY_CHARS} long), a "
                     f"number (an int within 2**61), None, or a tuple of at most {MAX_KEY_PARTS} strings and ints "
                     f"in [0, 2**32), found {brief(key)}")


def _complete(record: Record) -> bool:
    return record.built if type(record) is DtypeRecord else record.data is not None


def describe(value: Any) -> str:
    """What ``value`` is, for messages (a record by what it stands for)."""
    if type(value) is Entry:
        return f"the global {value.name}"
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    if isinstance(value, Record):
        return f"a {type(value).__name__[:-6] if type(value).__name__.endswith('Record') else type(value).__name__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}".replace("a builtins.", "a ")


def brief(value: Any, depth: int = 0) -> str:
    """A short text for ``value`` from a file, for messages: never the ``repr`` of a whole
    structure (a file's nested or shared data could make that endless)."""
    kind = type(value)
    if kind in (str, bytes, bytearray):
        text = repr(value[:40])
        return text + ("..." if len(value) > 40 else "")
    if kind is int:
        return str(value) if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"
    if kind in (bool, float, type(None)):
        return repr(value)
    if kind in (tuple, list) and depth < 2:
        items = ", ".join(brief(v, depth + 1) for v in value[:6]) + (", ..." if len(value) > 6 else "")
        return f"({items}{',' if kind is tuple and len(value) == 1 else ''})" if kind is tuple else f"[{items}]"
    return describe(value)


def _int(value: Any, what: str, low: int = 0, high: Optional[int] = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f" in [{low}, {high}]" if high is not None else f" >= {low}"
        raise refuse(f"{what}: expected an int{bound}, found {describe(value) if type(value) is not int else brief(value)}")
    return value


def _shape(value: Any, what: str) -> Tuple[int, ...]:
    if type(value) not in (tuple, list, torch.Size) or len(value) > MAX_DIMS:
        raise refuse(f"{what}: expected a tuple of at most {MAX_DIMS} sizes, found {describe(value)}")
    return tuple(_int(n, what, 0, MAX_SIZE - 1) for n in value)


# ---------------------------------------------------------------------------- numpy
#: The numpy dtypes an array or scalar may have (by the name numpy pickles): numbers and bools.
NUMPY_DTYPES = ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
#: Each dtype's BUILD state, as numpy writes it (a BUILD must equal it).
_DTYPE_STATES = {name: np.dtype(name).__reduce__()[2] for name in NUMPY_DTYPES}


def numpy_dtype(name: Any, align: Any = False, copy: Any = True) -> DtypeRecord:
    """``numpy.dtype(name, align, copy)`` as numpy pickles it."""
    if type(name) is not str or name not in NUMPY_DTYPES or align is not False or copy is not True:
        raise refuse(f"numpy.dtype{brief((name, align, copy))}: only the numeric dtypes {', '.join(NUMPY_DTYPES)} "
                     "are read (object, string, void and datetime dtypes are refused)")
    return DtypeRecord(name)


def build_dtype(record: DtypeRecord, state: Any) -> None:
    if record.built or type(state) is not tuple or not all(type(v) in (int, str, type(None)) for v in state) \
            or state != _DTYPE_STATES[record.name]:
        raise refuse(f"numpy.dtype({record.name!r}): its state must be numpy's own {_DTYPE_STATES[record.name]}, "
                     f"found {brief(state)}")
    record.built = True


def numpy_reconstruct(subtype: Any, shape: Any, dtype_char: Any) -> ArrayRecord:
    """``numpy.core.multiarray._reconstruct(ndarray, (0,), b'b')``: an empty array its BUILD fills."""
    if subtype is not ENTRIES["numpy.ndarray"] or shape != (0,) or type(shape) is not tuple \
            or dtype_char not in (b"b", "b"):
        raise refuse(f"numpy _reconstruct: expected (numpy.ndarray, (0,), b'b') as numpy writes it, found "
                     f"({describe(subtype)}, {brief(shape)}, {brief(dtype_char)})")
    return ArrayRecord()


def build_array(record: ArrayRecord, state: Any) -> None:
    """numpy's array state ``(1, shape, dtype, is_fortran, raw bytes)``, the bytes exactly
    ``prod(shape) * itemsize`` long."""
    if record.data is not None or type(state) is not tuple or len(state) != 5 or state[0] != 1 \
            or type(state[0]) is not int:
        raise refuse(f"numpy array: expected the state (1, shape, dtype, is_fortran, bytes), found {describe(state)}")
    _, shape, dtype, fortran, raw = state
    shape = _shape(shape, "numpy array shape")
    if type(dtype) is not DtypeRecord or not dtype.built:
        raise refuse(f"numpy array: its dtype must be a numeric numpy.dtype, found {describe(dtype)}")
    if type(fortran) is not bool:
        raise refuse(f"numpy array: is_fortran must be a bool, found {describe(fortran)}")
    if type(raw) is str:  # a Python 2 pickle's str: numpy's latin-1 bytes
        spend(len(raw), "numpy array")
        raw = raw.encode("latin-1")
    if type(raw) is not bytes:
        raise refuse(f"numpy array: its data must be bytes, found {describe(raw)} (object arrays are refused)")
    need = math.prod(shape) * np.dtype(dtype.name).itemsize
    if len(raw) != need:
        raise refuse(f"numpy array of shape {shape} and dtype {dtype.name}: needs {need} bytes, the file gives "
                     f"{len(raw)}")
    record.dtype, record.shape, record.fortran, record.data = dtype.name, shape, fortran, raw


def numpy_scalar(dtype: Any, data: Any = None) -> ScalarRecord:
    """``numpy.core.multiarray.scalar(dtype, bytes)``: ``itemsize`` bytes of a numeric dtype."""
    if type(dtype) is not DtypeRecord or not dtype.built:
        raise refuse(f"numpy scalar: its dtype must be a numeric numpy.dtype, found {describe(dtype)}")
    if type(data) is str:
        spend(len(data), "numpy scalar")
        data = data.encode("latin-1")
    if type(data) is not bytes or len(data) != np.dtype(dtype.name).itemsize:
        raise refuse(f"numpy scalar of dtype {dtype.name}: expected {np.dtype(dtype.name).itemsize} bytes, found "
                     f"{describe(data)}")
    return ScalarRecord(dtype.name, data)


# ---------------------------------------------------------------------------- mmengine
HISTORY_BUFFER = "mmengine.logging.history_buffer.HistoryBuffer"
#: The statistics mmengine pickles as ``getattr(HistoryBuffer, name)``.
HISTORY_STATISTICS = ("min", "max", "current", "mean")


def method_name(owner: Any, name: Any, *default: Any) -> MethodName:
    """``builtins.getattr(HistoryBuffer, 'min' | 'max' | 'current' | 'mean')``: the name, nothing
    looked up. Anything else is refused."""
    if owner is ENTRIES.get(HISTORY_BUFFER) and type(name) is str and name in HISTORY_STATISTICS and not default:
        return MethodName("HistoryBuffer", name)
    raise refuse(f"{ASKS_FOR_CODE}: builtins.getattr({describe(owner)}, {brief(name)}); only HistoryBuffer's statistics "
                 f"{'/'.join(HISTORY_STATISTICS)} are read, as names. It was refused, nothing in it ran")


def _history(value: Any, what: str) -> ArrayRecord:
    if type(value) is not ArrayRecord or value.data is None or len(value.shape) != 1:
        raise refuse(f"HistoryBuffer {what}: expected a 1-D numpy array, found {describe(value)}")
    return value


def build_history_buffer(record: HistoryBufferRecord, state: Any) -> None:
    """State ``{'max_length', '_log_history', '_count_history'[, 'statistics_methods' /
    '_statistics_methods': {name: getattr(HistoryBuffer, name)}]}``."""
    known = {"max_length", "_log_history", "_count_history", "statistics_methods", "_statistics_methods"}
    if record.log is not None or type(state) is not dict or not set(state) <= known \
            or not {"_log_history", "_count_history"} <= set(state):
        raise refuse(f"HistoryBuffer: expected its state {{max_length, _log_history, _count_history}}, found "
                     f"{brief(list(state)) if type(state) is dict else describe(state)}")
    for key in ("statistics_methods", "_statistics_methods"):
        methods = state.get(key, {})
        if type(methods) is not dict or not all(type(k) is str and type(v) is MethodName and v.name == k
                                                for k, v in methods.items()):
            raise refuse(f"HistoryBuffer {key}: expected {{name: getattr(HistoryBuffer, name)}} of "
                         f"{'/'.join(HISTORY_STATISTICS)}, found {describe(methods)}")
    log, count = _history(state["_log_history"], "_log_history"), _history(state["_count_history"], "_count_history")
    if log.shape != count.shape:
        raise refuse(f"HistoryBuffer: histories of lengths {log.shape[0]} and {count.shape[0]}")
    record.max_length = _int(state.get("max_length", 1000000), "HistoryBuffer max_length", 1, 2 ** 31)
    record.log, record.count = log, count


def build_message_hub(record: MessageHubRecord, state: Any) -> None:
    """An old ``MessageHub`` saved whole: ``{'_instance_name', '_log_scalars', '_runtime_info',
    '_resumed_keys'}``. It becomes the dict its ``state_dict()`` returns (what
    ``MessageHub.load_state_dict`` reads), never a registered hub instance."""
    known = {"_instance_name", "_log_scalars", "_runtime_info", "_resumed_keys"}
    if record.state is not None or type(state) is not dict or not set(state) <= known:
        raise refuse(f"MessageHub: expected its state {sorted(known)}, found "
                     f"{brief(list(state)) if type(state) is dict else describe(state)}")
    scalars = state.get("_log_scalars", {})
    if not isinstance(scalars, dict) or not all(type(v) is HistoryBufferRecord for v in scalars.values()):
        raise refuse("MessageHub _log_scalars: expected {name: HistoryBuffer}")
    record.state = dict(log_scalars=scalars, runtime_info=state.get("_runtime_info", {}),
                        resumed_keys=state.get("_resumed_keys", {}))


def config_dict(items: Any = None) -> ConfigDictRecord:
    """``ConfigDict(dict)``: a record of the dict, whose items :func:`materialize` checks (plain
    data, no key that names an attribute protocol, ``__x__``) once nothing can change them."""
    items = {} if items is None else items
    if type(items) is not dict:
        raise refuse(f"ConfigDict: expected a dict of plain data, found {describe(items)}")
    return ConfigDictRecord(items)


# ---------------------------------------------------------------------------- containers and builtins
def ordered_dict(items: Any = ()) -> collections.OrderedDict:
    if type(items) not in (list, tuple) or not all(type(p) in (list, tuple) and len(p) == 2 for p in items):
        raise refuse(f"collections.OrderedDict: expected () or a list of pairs, found {describe(items)}")
    spend(ITEM_BYTES * len(items), "collections.OrderedDict")  # (a copy: the pairs may be shared)
    for key, _ in items:
        check_key(key, "collections.OrderedDict")
    return collections.OrderedDict(items)


def counter(items: Any = None) -> collections.Counter:
    items = {} if items is None else items
    if type(items) is not dict or not all(type(v) in (int, float) for v in items.values()):
        raise refuse(f"collections.Counter: expected a dict of counts, found {describe(items)}")
    spend(ITEM_BYTES * len(items), "collections.Counter")  # (keys checked as the dict was filled)
    return collections.Counter(items)


#: The factories a pickled ``defaultdict`` may name (builtins that hold data). The factory is
#: behaviour, not data: the dict is read without it (``default_factory=None``).
DEFAULT_FACTORIES = ("builtins.list", "builtins.dict", "builtins.set", "builtins.int", "builtins.float")


def default_dict(factory: Any = None, items: Any = None) -> collections.defaultdict:
    if factory is not None and not (type(factory) is Entry and factory.name in DEFAULT_FACTORIES):
        raise refuse(f"collections.defaultdict: its factory must be None or one of {', '.join(DEFAULT_FACTORIES)}, "
                     f"found {describe(factory)}")
    out: collections.defaultdict = collections.defaultdict(None)
    if items is not None:
        if type(items) is not dict:
            raise refuse(f"collections.defaultdict: expected a dict of items, found {describe(items)}")
        spend(ITEM_BYTES * len(items), "collections.defaultdict")
        out.update(items)
    return out


def make_set(items: Any = ()) -> set:
    if type(items) not in (list, tuple):
        raise refuse(f"builtins.set: expected a list, found {describe(items)}")
    spend(ITEM_BYTES * len(items), "builtins.set")
    for item in items:
        check_key(item, "builtins.set")
    return set(items)


def make_frozenset(items: Any = ()) -> frozenset:
    return frozenset(make_set(items))


def codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode(str, 'latin1')``: how protocol 2 pickles ``bytes``."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise refuse(f"_codecs.encode: expected (str, 'latin1') as protocol 2 writes bytes, found "
                     f"({describe(text)}, {brief(encoding)})")
    spend(len(text), "_codecs.encode")
    return text.encode("latin-1")


# ---------------------------------------------------------------------------- torch
def _storage_elements(storage: Any) -> int:
    if type(storage) is torch.storage.TypedStorage:
        return storage._size()  # (the public size() warns that TypedStorage is deprecated)
    if type(storage) is torch.UntypedStorage:
        return storage.nbytes()
    raise refuse(f"a tensor's storage must be one the file holds, found {describe(storage)}")


def _check_view(storage: Any, offset: Any, size: Any, stride: Any, itemsize: int = 1) -> Tuple[tuple, tuple]:
    """A view inside the storage: offset, sizes and strides >= 0, the last element within it,
    at most :data:`MAX_VIEW_RATIO` times its elements."""
    elements = _storage_elements(storage) // (itemsize if type(storage) is torch.UntypedStorage else 1)
    offset = _int(offset, "tensor storage_offset")
    size, stride = _shape(size, "tensor size"), _shape(stride, "tensor stride")
    if len(size) != len(stride):
        raise refuse(f"tensor: {len(size)} sizes but {len(stride)} strides")
    numel = math.prod(size)
    if numel and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= elements:
        raise refuse(f"tensor of size {size}, stride {stride}, offset {offset}: reaches past its storage of "
                     f"{elements} elements")
    if numel > MAX_VIEW_RATIO * max(elements, 1):
        raise refuse(f"tensor of size {size}: {numel} elements over a storage of {elements}")
    return size, stride


def _no_hooks(hooks: Any) -> None:
    if hooks is not None and not (type(hooks) in (dict, collections.OrderedDict) and not hooks):
        raise refuse(f"tensor backward hooks: a checkpoint holds none (torch saves an empty OrderedDict), found "
                     f"{describe(hooks)}")


def _no_metadata(metadata: Any) -> None:
    if metadata is not None and not (type(metadata) is dict and not metadata):
        raise refuse(f"tensor metadata (conjugate / negative bits): not read, found {describe(metadata)}")


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise refuse(f"{what}: expected a bool, found {describe(value)}")
    return value


def rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> torch.Tensor:
    """``torch._utils._rebuild_tensor`` (old files)."""
    size, stride = _check_view(storage, offset, size, stride)
    return torch._utils._rebuild_tensor(storage, offset, size, stride)


def rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                      backward_hooks: Any = None, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2``: a view of a storage of the file, no hooks."""
    size, stride = _check_view(storage, offset, size, stride)
    _no_hooks(backward_hooks)
    _no_metadata(metadata)
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, _bool(requires_grad, "requires_grad"),
                                           collections.OrderedDict())


def rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, backward_hooks: Any,
                      dtype: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v3``: the dtypes torch keeps no typed storage for (uint16 ...)."""
    if type(dtype) is not torch.dtype:
        raise refuse(f"tensor dtype: expected a torch dtype, found {describe(dtype)}")
    if type(storage) is not torch.UntypedStorage:
        raise refuse(f"tensor (v3): expected an untyped storage, found {describe(storage)}")
    size, stride = _check_view(storage, offset, size, stride, itemsize=torch.empty((), dtype=dtype).element_size())
    _no_hooks(backward_hooks)
    _no_metadata(metadata)
    return torch._utils._rebuild_tensor_v3(storage, offset, size, stride, _bool(requires_grad, "requires_grad"),
                                           collections.OrderedDict(), dtype)


def rebuild_parameter(data: Any, requires_grad: Any = True, backward_hooks: Any = None) -> torch.nn.Parameter:
    """``torch._utils._rebuild_parameter``: ``nn.Parameter(tensor, requires_grad)``, no hooks."""
    if type(data) is not torch.Tensor:
        raise refuse(f"nn.Parameter: expected a tensor, found {describe(data)}")
    _no_hooks(backward_hooks)
    return torch.nn.Parameter(data, _bool(requires_grad, "requires_grad"))


def rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> torch.nn.Parameter:
    return _with_flags(rebuild_parameter(data, requires_grad, backward_hooks), state, "nn.Parameter")


#: A tensor's Python attribute a checkpoint may carry: a private flag's name (FSDP marks the
#: tensors of a full state dict ``_has_been_cloned``).
_FLAG = re.compile(r"_?[a-z][a-z0-9_]{0,63}")


def _with_flags(tensor: torch.Tensor, state: Any, what: str) -> torch.Tensor:
    """``tensor`` with the attributes of ``state`` (``{name: value}`` or ``(dict, slots)`` as
    torch pickles them): flags only, a name no tensor attribute has, a number, string or None."""
    if type(state) is tuple and len(state) == 2 and state[1] in (None, {}):
        state = state[0]
    if state in (None, (), {}):
        return tensor
    if type(state) is not dict:
        raise refuse(f"{what} state: expected a dict of flags, found {describe(state)}")
    for name, value in state.items():
        if type(name) is not str or not _FLAG.fullmatch(name) or name.endswith("_") or hasattr(torch.Tensor, name) \
                or type(value) not in (bool, int, float, str, type(None)):
            raise refuse(f"{what} with the Python attribute {brief(name)} = {describe(value)}: only flags (a new "
                         "private name, a number, string or None) are read")
    for name, value in state.items():
        setattr(tensor, name, value)
    return tensor


#: The rebuild rows a ``_rebuild_from_type_v2`` may call, and the types it may make.
_TENSOR_FUNCS = ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_tensor",
                 "torch._utils._rebuild_parameter")
_TENSOR_TYPES = {"torch._tensor.Tensor": torch.Tensor, "torch.Tensor": torch.Tensor,
                 "torch.nn.parameter.Parameter": torch.nn.Parameter}


def rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> torch.Tensor:
    """``torch._tensor._rebuild_from_type_v2(func, type, args, state)``: torch's calls whatever
    ``func`` is; here ``func`` must be one of the tensor rows, ``type`` a tensor or parameter,
    and ``state`` empty."""
    if type(func) is not Entry or func.name not in _TENSOR_FUNCS:
        raise refuse(f"_rebuild_from_type_v2: calls only torch's tensor rebuilds, found {describe(func)}")
    if type(new_type) is not Entry or new_type.name not in _TENSOR_TYPES:
        raise refuse(f"_rebuild_from_type_v2: makes only tensors and parameters, found {describe(new_type)}")
    if type(args) is not tuple:
        raise refuse(f"_rebuild_from_type_v2: expected a tuple of arguments, found {describe(args)}")
    out = call(func, args)
    want = _TENSOR_TYPES[new_type.name]
    if type(out) is not want:
        out = torch.nn.Parameter(out, out.requires_grad) if want is torch.nn.Parameter else \
            out.detach().requires_grad_(out.requires_grad)
    return _with_flags(out, state, "a tensor")


def torch_size(dims: Any = ()) -> torch.Size:
    return torch.Size(_shape(dims, "torch.Size"))


def torch_device(kind: Any, index: Any = None) -> torch.device:
    if type(kind) is not str or not re.fullmatch(r"[a-z_]{1,16}(:\d{1,4})?", kind) or not (
            index is None or type(index) is int and 0 <= index < 10000):
        raise refuse(f"torch.device: expected ('cpu' | 'cuda' ..., index), found ({brief(kind)}, {brief(index)})")
    try:
        return torch.device(kind) if index is None else torch.device(kind, index)
    except RuntimeError as err:  # a device type torch does not know
        raise refuse(f"torch.device({brief(kind)}): {str(err).splitlines()[0][:120]}") from None


# ---------------------------------------------------------------------------- the table
#: name -> what REDUCE on that row runs.
CALLS: Dict[str, Callable[..., Any]] = {
    "collections.OrderedDict": ordered_dict,
    "collections.Counter": counter,
    "collections.defaultdict": default_dict,
    "builtins.set": make_set,
    "builtins.frozenset": make_frozenset,
    "_codecs.encode": codecs_encode,
    "builtins.getattr": method_name,
    "numpy.dtype": numpy_dtype,
    "numpy.core.multiarray._reconstruct": numpy_reconstruct,
    "numpy._core.multiarray._reconstruct": numpy_reconstruct,
    "numpy.core.multiarray.scalar": numpy_scalar,
    "numpy._core.multiarray.scalar": numpy_scalar,
    "mmengine.config.config.ConfigDict": config_dict,
    "torch._utils._rebuild_tensor": rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": rebuild_parameter_with_state,
    "torch._tensor._rebuild_from_type_v2": rebuild_from_type_v2,
    "torch.Size": torch_size,
    "torch.device": torch_device,
}
#: name -> the record NEWOBJ of that row makes (classes pickled by ``copyreg.__newobj__``, with
#: no arguments: their BUILD brings the state).
NEWS: Dict[str, Callable[[], Any]] = {
    HISTORY_BUFFER: HistoryBufferRecord,
    "mmengine.logging.message_hub.MessageHub": MessageHubRecord,
}
#: Rows that are names only (arguments of the rows above).
NAMES = ("numpy.ndarray", "builtins.list", "builtins.dict", "builtins.int", "builtins.float", *_TENSOR_TYPES)
#: record type -> what BUILD on it runs.
BUILDS: Dict[type, Callable[[Any, Any], None]] = {
    DtypeRecord: build_dtype,
    ArrayRecord: build_array,
    HistoryBufferRecord: build_history_buffer,
    MessageHubRecord: build_message_hub,
}
#: Every row: ``GLOBAL module name`` pushes ``ENTRIES[name]``.
ENTRIES: Dict[str, Entry] = {name: Entry(name) for name in (*CALLS, *NEWS, *NAMES)}
#: Values a global may name directly: torch's dtypes (inert values) and the untyped storage
#: class torch's loader compares storage types with.
CONSTANTS: Dict[str, Any] = {f"torch.{name}": value for name, value in vars(torch).items()
                             if isinstance(value, torch.dtype)}
CONSTANTS["torch.UntypedStorage"] = torch.UntypedStorage


def call(func: Any, args: Any) -> Any:
    """REDUCE: ``func`` must be a row of :data:`CALLS`; its handler checks ``args``."""
    handler = CALLS.get(func.name) if type(func) is Entry else None
    if handler is None:
        raise refuse(f"{ASKS_FOR_CODE}: it calls {describe(func)}, which the loader never calls; it was refused, "
                     "nothing in it ran")
    if type(args) is not tuple:
        raise refuse(f"{func.name}: expected a tuple of arguments, found {describe(args)}")
    try:
        return handler(*args)
    except TypeError as err:  # a wrong number of arguments
        raise refuse(f"{func.name}: {len(args)} arguments do not fit it ({err})") from None


def new(cls: Any, args: Any, kwargs: Any = None) -> Any:
    """NEWOBJ / NEWOBJ_EX: ``cls`` must be a row of :data:`NEWS`."""
    handler = NEWS.get(cls.name) if type(cls) is Entry else None
    if handler is None:
        raise refuse(f"{ASKS_FOR_CODE}: it creates {describe(cls)}, which the loader never creates; it was refused, "
                     "nothing in it ran")
    if type(args) is not tuple or args or kwargs not in (None, {}):
        raise refuse(f"{cls.name}: expected no arguments to its NEWOBJ, found {brief(args)}"
                     + ("" if kwargs in (None, {}) else f" and keyword arguments ({brief(kwargs)})"))
    return handler()


def build(inst: Any, state: Any) -> None:
    """BUILD: state for a record of :data:`BUILDS`, or torch's ``_metadata`` of a state dict."""
    handler = BUILDS.get(type(inst))
    if handler is not None:
        handler(inst, state)
        return
    if type(inst) is collections.OrderedDict and type(state) is dict and set(state) <= {"_metadata"} \
            and not hasattr(inst, "_metadata"):
        metadata = state.get("_metadata")
        if metadata is not None and type(metadata) not in (dict, collections.OrderedDict):
            raise refuse(f"a state dict's _metadata: expected a dict of module versions, found {describe(metadata)}")
        inst._metadata = metadata  # (its versions read by module_versions when made)  # type: ignore[attr-defined]
        return
    raise refuse(f"the file asks to set the state of {describe(inst)} ({describe(state)}); only numpy dtypes and "
                 "arrays, HistoryBuffer, MessageHub and a state dict's _metadata take state")


# ---------------------------------------------------------------------------- after unpickling
def materialize(value: Any, trusted: Tuple[type, ...] = ()) -> Any:
    """The unpickled ``value`` with every record replaced by the real object, each made through
    its public constructor from checked numbers and bytes (shared parts stay shared). Refuses
    what is not plain data (an :class:`Entry`, a :class:`MethodName` outside a HistoryBuffer),
    nesting deeper than :data:`MAX_DEPTH` and cycles. Instances of ``trusted`` classes (a load's
    own, :func:`~.unpickler.read_torch_checkpoint`) are kept as they are."""
    done: Dict[int, Tuple[Any, int, int, int]] = {}  # id -> (what it became, height, expanded size, bytes)
    active: set = set()
    config_checked: set = set()  # (the containers a ConfigDict's check has seen: each once per load)
    deep = refuse(f"data nested deeper than {MAX_DEPTH} levels")

    def walk(value: Any, depth: int) -> Tuple[Any, int, int, int]:
        kind = type(value)
        if is_tensor(value):  # (what a consumer that copies it makes, at every place it hangs: views of one
            nbytes = value.numel() * value.element_size()  # storage, one tensor named many times)
            spend(nbytes, "tensor")
            return value, 0, 1, nbytes
        if kind is str or kind is bytes:  # (as tensors: what a consumer that prints or copies it makes)
            spend(len(value), "text")
            return value, 0, 1, len(value)
        if kind in PLAIN_LEAVES or kind in (torch.storage.TypedStorage, torch.UntypedStorage):
            return value, 0, 1, 0
        if trusted and isinstance(value, trusted):  # (their attributes again: the memo can fill them after BUILD)
            if not isinstance(value, enum.Enum):
                check_trusted_state(dict(vars(value)) if hasattr(value, "__dict__") else {}, trusted,
                                    describe(value))
            return value, 0, 1, 0
        key = id(value)
        if key in done:  # shared: made once; its height, size, tensors and text count wherever it hangs
            out, height, size, nbytes = done[key]
            if depth + height > MAX_DEPTH:
                raise deep
            spend(nbytes, "tensors and text")
            return out, height, size, nbytes
        if key in active:
            raise refuse("the data refers to itself (a cycle)")
        if depth >= MAX_DEPTH:
            raise deep
        height, size, nbytes = [0], [1], [0]
        limit, what = (MAX_CONFIG_EXPANDED, "a ConfigDict") if kind is ConfigDictRecord else (MAX_EXPANDED, "the data")

        def child(v: Any) -> Any:
            out, h, n, b = walk(v, depth + 1)
            height[0] = max(height[0], h + 1)
            size[0] += n
            nbytes[0] += b
            if size[0] > limit:  # (before a ConfigDict copies it along every path)
                raise refuse(f"{what} holds more than {limit} objects counted along every path (shared "
                             "parts multiply)")
            return out

        active.add(key)
        try:
            out = _made(value, child, config_checked)
        finally:
            active.discard(key)
        done[key] = (out, height[0], size[0], nbytes[0])
        return done[key]

    return walk(value, 0)[0]


def module_versions(metadata: Any) -> collections.OrderedDict:
    """A state dict's ``_metadata`` as torch writes it, ``{module prefix: {'version': int}}``,
    read from the file's: other entries and keys are left out (``load_state_dict`` reads more
    keys there, e.g. ``assign_to_params_buffers``, which would make it adopt the file's tensors
    as parameters, strides and aliasing included)."""
    out: collections.OrderedDict = collections.OrderedDict()
    if isinstance(metadata, dict):
        spend(ITEM_BYTES * len(metadata), "a state dict's _metadata")  # (one copy per state dict naming it)
        for prefix, entry in metadata.items():
            if type(prefix) is str and type(entry) is dict:
                version = entry.get("version")
                out[prefix] = {"version": version} if type(version) is int else {}
    return out


def _made(value: Any, walk: Callable[[Any], Any], config_checked: set) -> Any:
    kind = type(value)
    if kind is ArrayRecord:
        if value.data is None:
            raise refuse("a numpy array without its state")
        spend(len(value.data), "numpy array")
        array = np.frombuffer(value.data, dtype=np.dtype(value.dtype))
        return array.reshape(value.shape, order="F" if value.fortran else "C").copy(order="K")
    if kind is ScalarRecord:
        return np.frombuffer(value.data, dtype=np.dtype(value.dtype))[0]
    if kind is HistoryBufferRecord:
        if value.log is None:
            raise refuse("a HistoryBuffer without its state")
        from mmengine.logging import HistoryBuffer

        spend(len(value.log.data) + len(value.count.data), "HistoryBuffer")  # (it copies its histories)
        return HistoryBuffer(walk(value.log), walk(value.count), value.max_length)
    if kind is MessageHubRecord:
        if value.state is None:
            raise refuse("a MessageHub without its state")
        return walk(value.state)
    if kind is ConfigDictRecord:
        from mmengine.config import ConfigDict

        # Checked again now that nothing can change it: the file's memo can fill the dict after
        # its REDUCE (a key such as __array_interface__ would make the real ConfigDict answer numpy).
        check_plain(value.items, "ConfigDict", seen=config_checked, dunder_keys=False)
        return ConfigDict(walk(value.items))
    if kind in (set, frozenset):
        for item in value:
            check_key(item, "a set", inserted=False)
        return value
    if kind in (list, tuple):
        items = [walk(v) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)
    if kind in (dict, collections.OrderedDict, collections.Counter, collections.defaultdict):
        for k in value:
            check_key(k, "a dict", inserted=False)
        items = [(k, walk(v)) for k, v in value.items()]
        out = value
        if not all(a is b for (_, a), b in zip(items, value.values())):
            out = (collections.defaultdict(value.default_factory, items) if kind is collections.defaultdict
                   else kind(dict(items)) if kind is collections.Counter else kind(items))
        if hasattr(value, "_metadata"):
            out._metadata = module_versions(value._metadata)  # type: ignore[union-attr]
        return out
    raise refuse(f"the data holds {describe(value)}, which is not data")
