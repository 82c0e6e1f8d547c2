"""Pickles written opcode by opcode, as an attacker writes them (tests/checkpoint/test_gadget_chains.py)."""
from __future__ import annotations

import io
import pickle
import struct
import zipfile

import torch

PROTO2 = b"\x80\x02"
NONE, TRUE, FALSE = pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE


def g(name: str) -> bytes:
    """GLOBAL ``module name`` (the last dot splits them)."""
    module, _, attr = name.rpartition(".")
    return pickle.GLOBAL + f"{module}\n{attr}\n".encode()


def s(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def i(n: int) -> bytes:
    if -2 ** 31 <= n < 2 ** 31:
        return pickle.BININT + struct.pack("<i", n)
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(data)]) + data


def b(data: bytes) -> bytes:
    return pickle.BINBYTES + struct.pack("<I", len(data)) + data


def t(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def l(*items: bytes) -> bytes:  # noqa: E741
    return pickle.EMPTY_LIST + (pickle.MARK + b"".join(items) + pickle.APPENDS if items else b"")


def d(*pairs: bytes) -> bytes:
    """A dict of ``(key, value)`` opcode pairs."""
    return pickle.EMPTY_DICT + (pickle.MARK + b"".join(k + v for k, v in pairs) + pickle.SETITEMS if pairs else b"")


def call(fn: bytes, *args: bytes) -> bytes:
    return fn + t(*args) + pickle.REDUCE


def new(cls: bytes, *args: bytes) -> bytes:
    return cls + t(*args) + pickle.NEWOBJ


def build(obj: bytes, state: bytes) -> bytes:
    return obj + state + pickle.BUILD


def program(body: bytes) -> bytes:
    return PROTO2 + body + pickle.STOP


def put(n: int) -> bytes:
    return pickle.BINPUT + bytes([n])


def get(n: int) -> bytes:
    return pickle.BINGET + bytes([n])


# ---- numpy as numpy pickles it
def np_dtype(name: str, state: bytes = None) -> bytes:
    default = t(i(3), s("<"), NONE, NONE, NONE, i(-1), i(-1), i(0))
    return build(call(g("numpy.dtype"), s(name), FALSE, TRUE), default if state is None else state)


def np_array(shape: tuple, dtype: bytes, raw: bytes, reconstruct="numpy._core.multiarray._reconstruct") -> bytes:
    empty = call(g(reconstruct), g("numpy.ndarray"), t(i(0)), b(b"b"))
    return build(empty, t(i(1), t(*map(i, shape)), dtype, FALSE, raw))


def tensor(key: str = "0", numel: int = 4, offset: int = 0, size=(4,), stride=(1,), storage="torch.FloatStorage") -> bytes:
    """``_rebuild_tensor_v2`` of storage ``key`` (a record of the archive :func:`in_zip` writes)."""
    pid = t(s("storage"), g(storage), s(key), s("cpu"), i(numel)) + pickle.BINPERSID
    return call(g("torch._utils._rebuild_tensor_v2"), pid, i(offset), t(*map(i, size)), t(*map(i, stride)), FALSE,
                call(g("collections.OrderedDict")))


def in_zip(path, data_pkl: bytes, tensor_values=None) -> str:
    """A torch zip checkpoint (torch's own writer) whose ``data.pkl`` is replaced by ``data_pkl``;
    its storage ``0`` holds ``tensor_values`` (default: 4 float32 ones)."""
    values = torch.ones(4) if tensor_values is None else tensor_values
    torch.save({"w": values}, path)
    with zipfile.ZipFile(path) as z:
        members = [(info.filename, z.read(info.filename)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data_pkl if name.endswith("data.pkl") else data)
    return str(path)


def legacy(path, data_pkl: bytes, storages: bytes = b"") -> str:
    """A legacy (non-zip) torch file: magic, protocol, sys info, ``data_pkl``, the storage keys
    (none), then ``storages``."""
    out = io.BytesIO()
    for value in (0x1950A86A20F9469CFC6C, 1001, dict(protocol_version=1001, little_endian=True)):
        pickle.dump(value, out, protocol=2)
    out.write(data_pkl)
    pickle.dump([], out, protocol=2)
    out.write(storages)
    with open(path, "wb") as f:
        f.write(out.getvalue())
    return str(path)


def twin_zip(path, members, python_view) -> str:
    """An archive two zip readers read differently (the review's trick): the local records and a
    central directory of ``members`` (``[(name, bytes)]``) at the offset the end record names,
    where torch's miniz looks; a second central directory of ``python_view`` (``[(name, size)]``,
    pointing at the same records) right before the end record, where Python's zipfile looks
    (end record - directory size)."""
    import zlib

    out, offsets = io.BytesIO(), []
    for name, data in members:
        offsets.append(out.tell())
        encoded = name.encode()
        out.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data),
                              len(encoded), 0) + encoded + data)

    def directory(entries):
        return b"".join(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, size, size,
                                    len(name.encode()), 0, 0, 0, 0, 0, offset) + name.encode()
                        for name, size, crc, offset in entries)

    by_name = dict(zip((n for n, _ in members), zip(offsets, (d for _, d in members))))
    for_torch = directory([(n, len(d), zlib.crc32(d), o) for (n, d), o in zip(members, offsets)])
    for_python = directory([(n, size, zlib.crc32(by_name[n][1]) if n in by_name else 0, by_name.get(n, (0,))[0])
                            for n, size in python_view])
    start = out.tell()
    out.write(for_torch + for_python)
    out.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members), len(for_python), start, 0))
    with open(path, "wb") as f:
        f.write(out.getvalue())
    return str(path)
