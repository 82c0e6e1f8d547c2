"""Checkpoint files: what a file holds (by its first bytes), reading it as weights only, and
writing converted files atomically.

Readable containers:

=============== =====================================================================================
torch zip       ``torch.save`` (torch >= 1.6): a zip archive; torch reads the container, :mod:`.unpickler` the pickle
torch pickle    ``torch.save(..., _use_new_zipfile_serialization=False)``: a pickle stream, same reader
safetensors     8-byte little-endian header length, a JSON header, raw tensor bytes; read with the
                ``safetensors`` library (no pickle at all), or by ``torch.load`` where the library is
                not installed and the installed torch reads safetensors itself
=============== =====================================================================================

Anything else (a directory, a FIFO or device, an empty, text or random file, a truncated
download) is a :class:`~swin_backbone.checkpoint.CheckpointError` naming the file, what was
expected and what was found, before any unpickler sees it. A torch file's pickle is read by
the package's inert unpickler (:mod:`.unpickler`): a pickle that names anything outside its
table is refused with the global's name, and nothing in it runs (docs/checkpoints.md,
"Security model").

Every file the package writes (converted checkpoints, downloads and their records, the tools'
outputs) goes through :func:`atomic_path`: a reader sees the old file or the new one, never half.
"""
from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import stat
import struct
import uuid
import zipfile
from collections import OrderedDict
from typing import Dict, Iterator, List, Mapping, Optional, Union

import torch

from ..torch_compat import load
from .base import CheckpointError
from .records import MAX_DIMS, RefusedError, brief
from .unpickler import ASKS_FOR_CODE, read_torch_checkpoint

PathLike = Union[str, "os.PathLike[str]"]

ZIP_MAGIC = b"PK\x03\x04"
#: pickle protocols 2..5 start with PROTO (0x80) and the protocol number (torch's legacy format).
PICKLE_PROTOCOLS = tuple(bytes([0x80, p]) for p in range(2, 6))
#: A safetensors header longer than this is not believed (the format itself caps it at 100 MB).
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
#: A safetensors file naming more tensors than this is not believed (a Swin-G checkpoint names
#: about 2000; each entry costs about a kilobyte of Python objects to read).
MAX_SAFETENSORS_TENSORS = 1 << 16

EXPECTED_ANY = "a torch checkpoint (torch.save: zip or legacy pickle) or a safetensors file"
EXPECTED_SAFETENSORS = "a safetensors file (by its .safetensors name)"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No file at the checkpoint path (a :class:`CheckpointError` and a ``FileNotFoundError``)."""


def is_safetensors_name(path: str) -> bool:
    return path.lower().endswith(".safetensors")


def expected_for(path: str) -> str:
    """What a file of this name should hold, for error messages."""
    return EXPECTED_SAFETENSORS if is_safetensors_name(path) else EXPECTED_ANY


def describe_bytes(head: bytes, size: int) -> str:
    """A short human description of a file's first bytes (``head``) and size, e.g.
    ``"text starting with 'hello'"`` or ``"binary data (1024 bytes) starting with 00 1f 8b ..."``."""
    if not head:
        return "an empty file"
    try:  # incremental: a character cut at the end of ``head`` is not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
        printable = all(c.isprintable() or c in "\r\n\t" for c in text)
    except UnicodeDecodeError:
        printable = False
    if printable:
        first = text.strip().splitlines()[0] if text.strip() else ""
        return f"text ({size} bytes) starting with {first[:40]!r}"
    return f"binary data ({size} bytes) starting with {head[:8].hex(' ')}"


def sniff(path: str) -> str:
    """Container of the file at ``path`` from its first bytes: ``'torch-zip'``,
    ``'torch-pickle'`` or ``'safetensors'``.

    Raises:
        CheckpointError: missing path, a directory, an empty file or one of none of these kinds;
            the message names the file, what was expected and what was found.
    """
    expected = expected_for(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"checkpoint {path!r}: no such file (expected {expected})")
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        inside = [n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, n))]
        hint = f"; pass the weights file inside it, e.g. {os.path.join(path, inside[0])!r}" if inside else ""
        raise CheckpointError(f"checkpoint {path!r}: is a directory, expected a file: {expected}{hint}")
    if not stat.S_ISREG(mode):  # never opened: a FIFO blocks, a device never ends
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) \
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file"
        raise CheckpointError(f"checkpoint {path!r}: is {kind}, not a regular file (expected {expected}); "
                              "pass the path of the checkpoint file itself")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"checkpoint {path!r}: the file is empty (expected {expected})")
    with open(path, "rb") as f:
        head = f.read(64)
    kind = _kind(head)
    if kind == "safetensors" or (kind and not is_safetensors_name(path)):
        return kind
    found = KIND_NAMES[kind] if kind else describe_bytes(head, size)
    raise CheckpointError(f"checkpoint {path!r}: expected {expected}; found {found}")


KIND_NAMES = {
    "torch-zip": "a torch zip archive (torch.save), not safetensors; rename it to .pth",
    "torch-pickle": "a pickle stream (torch.save legacy format), not safetensors; rename it to .pth",
}


def _kind(head: bytes) -> str:
    """``'torch-zip'`` / ``'torch-pickle'`` / ``'safetensors'`` from a file's first bytes, or ''."""
    if head.startswith(ZIP_MAGIC):
        return "torch-zip"
    if head[:2] in PICKLE_PROTOCOLS:
        return "torch-pickle"
    return "safetensors" if _looks_like_safetensors(head) else ""


def _looks_like_safetensors(head: bytes) -> bool:
    """8-byte header length (plausible), then the JSON header's ``{``."""
    if len(head) < 9:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 2 <= length <= MAX_SAFETENSORS_HEADER and head[8:9] == b"{"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 160 else line[:157] + "..."


def read_torch_file(path: str, kind: str, map_location: Union[str, torch.device] = "cpu",
                    trusted: Optional[Dict[str, object]] = None) -> object:
    """A sniffed torch file, its pickle read by the inert unpickler (:mod:`.unpickler`;
    ``trusted``: see :func:`~.unpickler.read_torch_checkpoint`); any failure is a
    :class:`CheckpointError` naming the file (never a bare error from inside the unpickler), and
    a refused file says what it asked for."""
    try:
        return read_torch_checkpoint(path, kind, map_location, trusted)
    except RefusedError as err:
        text = str(err)
        if not text.startswith(ASKS_FOR_CODE):
            # (a load with trusted classes ran their code: the FSDP strategy's own shards)
            text = f"refused, nothing in it ran: {text}" if err.ran_nothing and not trusted else f"refused: {text}"
        raise CheckpointError(f"checkpoint {path!r}: {text}") from None
    except Exception as err:  # torch's container reader raises anything from IndexError to RuntimeError
        what = "zip archive" if kind == "torch-zip" else "pickle stream"
        raise CheckpointError(
            f"checkpoint {path!r}: expected {EXPECTED_ANY}; found a {what} that cannot be read "
            f"({type(err).__name__}: {_first_line(err)}); the file is corrupt, truncated or not a checkpoint") from err


def read_safetensors(path: str, map_location: Union[str, torch.device] = "cpu") -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors file (weights only: no pickle), in the file's order.

    Read with the ``safetensors`` library; without it, by ``torch.load`` where the installed
    torch reads safetensors, else a :class:`CheckpointError` saying what to install.
    """
    _check_safetensors_header(path)
    try:
        from safetensors import safe_open
    except ImportError:
        return _safetensors_through_torch(path, map_location)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            state = OrderedDict((key, f.get_tensor(key)) for key in f.keys())
    except Exception as err:  # SafetensorError, OSError: never without the path
        raise CheckpointError(
            f"checkpoint {path!r}: expected a complete safetensors file; safetensors cannot read it "
            f"({type(err).__name__}: {_first_line(err)}); the file is truncated or corrupt"
        ) from err
    if map_location is not None and str(map_location) != "cpu":
        state = OrderedDict((k, v.to(map_location)) for k, v in state.items())
    return state


def _check_safetensors_header(path: str) -> None:
    """The header's length, JSON and entries (``{name: {dtype, shape, data_offsets}}``), checked
    before any tensor is read, so a truncated or garbled file names itself (the library's own
    errors do not name the file)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(min(length, MAX_SAFETENSORS_HEADER))
    if 8 + length > size:
        raise CheckpointError(
            f"checkpoint {path!r}: expected a complete safetensors file; its header says {length} header "
            f"bytes but the file has {size} bytes in all (truncated)"
        )
    # JSON makes up to ~60 bytes of Python objects per byte it reads (``[[],[],...]``): counted by
    # the bytes that open a container or an item, which no string escape can make, before parsing.
    containers, items = raw.count(b"{") + raw.count(b"["), raw.count(b",")
    if containers > 4 * MAX_SAFETENSORS_TENSORS or items > 48 * MAX_SAFETENSORS_TENSORS:
        raise CheckpointError(
            f"checkpoint {path!r}: expected a safetensors file; its header holds {containers} JSON objects and "
            f"lists and {items} items, more than a checkpoint of {MAX_SAFETENSORS_TENSORS} tensors may hold")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(
            f"checkpoint {path!r}: expected a safetensors file; its header is not JSON ({_first_line(err)})"
        ) from err
    problem = _header_problem(header)
    if problem:
        raise CheckpointError(f"checkpoint {path!r}: expected a safetensors file; its header is malformed: {problem} "
                              "(a damaged file, or not written by safetensors)")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if ends and 8 + length + max(ends) > size:
        raise CheckpointError(
            f"checkpoint {path!r}: expected a complete safetensors file; its tensors need "
            f"{8 + length + max(ends)} bytes but the file has {size} (truncated)"
        )


def _header_problem(header: object) -> str:
    """What is wrong with a parsed safetensors header, or ''."""
    if not isinstance(header, dict):
        return f"expected a JSON object, found {type(header).__name__}"
    if len(header) > MAX_SAFETENSORS_TENSORS + 1:
        return f"it names {len(header)} tensors, more than the {MAX_SAFETENSORS_TENSORS} a checkpoint may hold"
    for key, entry in header.items():
        if key == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                return "__metadata__ must map names to strings"
            continue
        if not isinstance(entry, dict):
            return f"tensor {key[:60]!r}: expected an object, found {type(entry).__name__}"
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(entry.get("dtype"), str):
            return f"tensor {key[:60]!r}: dtype must be a string"
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(n) is int and 0 <= n < 2 ** 63
                                                                           for n in shape):
            return f"tensor {key[:60]!r}: shape must be a list of at most {MAX_DIMS} sizes >= 0, found {brief(shape)}"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                and 0 <= offsets[0] <= offsets[1] < 2 ** 63):
            return f"tensor {key[:60]!r}: data_offsets must be [begin, end] with 0 <= begin <= end, found " \
                   f"{str(offsets)[:60]}"
    return ""


def _safetensors_through_torch(path: str, map_location: Union[str, torch.device]) -> Dict[str, torch.Tensor]:
    try:
        obj = load(path, map_location=map_location)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path!r}: a safetensors file, and the installed torch {torch.__version__} cannot read "
            f"safetensors ({type(err).__name__}: {_first_line(err)}); install the 'safetensors' package "
            "(pip install safetensors)"
        ) from err
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint {path!r}: expected a dict of tensors, got {type(obj).__name__}")
    return OrderedDict(obj)


def read_file(path: PathLike, map_location: Union[str, torch.device] = "cpu") -> object:
    """Read a local checkpoint file as weights only (torch zip / pickle with ``weights_only=True``,
    safetensors without pickle), with errors that say what is wrong. URLs and other references
    go through :func:`~swin_backbone.checkpoint.read_checkpoint` (:mod:`.loading`).

    Returns:
        What the file holds: a dict (a state dict, or a wrapper such as ``{'state_dict': ...}``).
    Raises:
        CheckpointNotFoundError: no file at ``path`` (also a ``FileNotFoundError``).
        CheckpointError: a directory, an empty / text / random / truncated file, or one torch
            cannot read; the message names the file, what was expected and what was found.
    """
    path = os.fspath(path)
    kind = sniff(path)
    if kind == "safetensors":
        return read_safetensors(path, map_location)
    return read_torch_file(path, kind, map_location)


# ---------------------------------------------------------------- writing
def _plain_tensors(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Contiguous copies that share no memory (safetensors refuses views of one storage, e.g.
    the q / k / v slices of one fused tensor)."""
    return OrderedDict((k, v.detach().to("cpu").contiguous().clone()) for k, v in state.items())


#: The temporary files of :func:`atomic_path`: ``.<name>.<32 hex digits>.tmp`` beside ``<name>``.
TEMP_NAME = ".{name}.{token}.tmp"
#: Longest file name the temporary name keeps whole (file systems allow 255 bytes).
_MAX_TEMP_BASE = 200


def temp_files_of(path: str) -> List[str]:
    """The temporary files :func:`atomic_path` may have left for exactly ``path`` (a killed
    writer's): never another file's (``x.pth`` does not match ``x.pth.tar``'s)."""
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(TEMP_NAME.format(name=name[:_MAX_TEMP_BASE], token="@")).replace("@",
                                                                                                  "[0-9a-f]{32}"))
    try:
        return sorted(os.path.join(folder, n) for n in os.listdir(folder) if pattern.fullmatch(n))
    except OSError:
        return []


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A fresh temporary name beside ``path`` (:data:`TEMP_NAME`) to write to; renamed onto ``path``
    when the block ends without an error, removed otherwise. A reader (or a rerun after a
    crash) sees the old file or the new one, never half of one; the file gets the mode a plain
    ``open`` gives (the umask's). Creates ``path``'s folder where missing."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, TEMP_NAME.format(name=name[:_MAX_TEMP_BASE], token=uuid.uuid4().hex))
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def atomic_write(path: str, data: Union[bytes, str]) -> None:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` whole or not at all (:func:`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def write_checkpoint(path: str, state: Mapping[str, torch.Tensor], meta: Optional[Mapping[str, object]] = None) -> None:
    """Write ``state`` to ``path`` atomically (:func:`atomic_path`: a failure leaves no partial file).

    ``*.safetensors``: the tensors, with ``meta`` as string metadata (JSON for non-strings);
    any other name: ``torch.save({'state_dict': state, 'meta': meta})``.
    """
    with atomic_path(path) as tmp:
        if is_safetensors_name(path):
            from safetensors.torch import save_file

            metadata = {"format": "pt"}
            metadata.update({str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()})
            save_file(_plain_tensors(state), tmp, metadata=metadata)
        else:
            torch.save({"state_dict": OrderedDict(state), "meta": dict(meta or {})}, tmp)
