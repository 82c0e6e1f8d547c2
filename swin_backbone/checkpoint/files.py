"""Checkpoint files: what a file holds (by its first bytes), reading it as weights only, and
writing converted files atomically.

Readable containers:

=============== =====================================================================================
torch zip       ``torch.save`` (torch >= 1.6): a zip archive, read with ``torch.load(weights_only=True)``
torch pickle    ``torch.save(..., _use_new_zipfile_serialization=False)``: a pickle stream, same reader
safetensors     8-byte little-endian header length, a JSON header, raw tensor bytes; read with the
                ``safetensors`` library (no pickle at all), or by ``torch.load`` where the library is
                not installed and the installed torch reads safetensors itself
=============== =====================================================================================

Anything else (a directory, an empty, text or random file, a truncated download) is a
:class:`~swin_backbone.checkpoint.CheckpointError` naming the file, what was expected
and what was found, before torch's unpickler sees it.
"""
from __future__ import annotations

import codecs
import json
import os
import struct
import tempfile
from collections import OrderedDict
from typing import Dict, Mapping, Optional, Union

import torch

from ..torch_compat import load
from .base import CheckpointError

PathLike = Union[str, "os.PathLike[str]"]

ZIP_MAGIC = b"PK\x03\x04"
#: pickle protocols 2..5 start with PROTO (0x80) and the protocol number (torch's legacy format).
PICKLE_PROTOCOLS = tuple(bytes([0x80, p]) for p in range(2, 6))
#: A safetensors header longer than this is not believed (the format itself caps it at 100 MB).
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024

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
    if os.path.isdir(path):
        inside = [n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, n))]
        hint = f"; pass the weights file inside it, e.g. {os.path.join(path, inside[0])!r}" if inside else ""
        raise CheckpointError(f"checkpoint {path!r}: is a directory, expected a file: {expected}{hint}")
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


def read_torch_file(path: str, kind: str, map_location: Union[str, torch.device] = "cpu") -> object:
    """``torch.load(weights_only=True)`` of a sniffed torch file; any failure is a
    :class:`CheckpointError` naming the file (never a bare error from inside the unpickler)."""
    from ..mmlab.compat import allow_mmengine_checkpoints

    allow_mmengine_checkpoints()  # Runner checkpoints, without weights_only=False
    try:
        return load(path, map_location=map_location)
    except Exception as err:  # the unpickler raises anything from IndexError to RuntimeError
        what = "zip archive" if kind == "torch-zip" else "pickle stream"
        hint = ("it holds objects other than tensors and plain data (weights_only refuses them)"
                if "weights_only" in str(err) or "Weights only" in str(err)
                else "the file is corrupt, truncated or not a checkpoint")
        raise CheckpointError(
            f"checkpoint {path!r}: expected {EXPECTED_ANY}; found a {what} that torch.load cannot read "
            f"({type(err).__name__}: {_first_line(err)}); {hint}"
        ) from err


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
    if str(map_location) != "cpu":
        state = OrderedDict((k, v.to(map_location)) for k, v in state.items())
    return state


def _check_safetensors_header(path: str) -> None:
    """The header's length and JSON, checked before any tensor is read, so a truncated or
    garbled file names itself (the library's own errors do not name the file)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = f.read(min(length, MAX_SAFETENSORS_HEADER))
    if 8 + length > size:
        raise CheckpointError(
            f"checkpoint {path!r}: expected a complete safetensors file; its header says {length} header "
            f"bytes but the file has {size} bytes in all (truncated)"
        )
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path!r}: expected a safetensors file; its header is not JSON ({_first_line(err)})"
        ) from err
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and "data_offsets" in v]
    if ends and 8 + length + max(ends) > size:
        raise CheckpointError(
            f"checkpoint {path!r}: expected a complete safetensors file; its tensors need "
            f"{8 + length + max(ends)} bytes but the file has {size} (truncated)"
        )


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


def write_checkpoint(path: str, state: Mapping[str, torch.Tensor], meta: Optional[Mapping[str, object]] = None) -> None:
    """Write ``state`` to ``path`` atomically (a temporary file in the same folder, then a rename:
    a failure leaves no partial file).

    ``*.safetensors``: the tensors, with ``meta`` as string metadata (JSON for non-strings);
    any other name: ``torch.save({'state_dict': state, 'meta': meta})``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        if is_safetensors_name(path):
            from safetensors.torch import save_file

            metadata = {"format": "pt"}
            metadata.update({str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()})
            save_file(_plain_tensors(state), tmp, metadata=metadata)
        else:
            torch.save({"state_dict": OrderedDict(state), "meta": dict(meta or {})}, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
