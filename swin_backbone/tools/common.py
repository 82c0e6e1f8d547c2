"""What both command-line tools need: files written whole or not at all, and errors in one line."""
from __future__ import annotations

import os


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, then rename it into place: a reader
    (or a rerun after a crash) sees the old file or the new one, never half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (every run of whitespace, newlines included, one space)."""
    return " ".join(str(err).split())
