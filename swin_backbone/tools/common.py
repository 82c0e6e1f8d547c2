"""What both command-line tools need: files written whole or not at all, and errors in one line."""
from __future__ import annotations

from ..checkpoint.files import atomic_write

__all__ = ["atomic_write", "one_line"]


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (every run of whitespace, newlines included, one space)."""
    return " ".join(str(err).split())
