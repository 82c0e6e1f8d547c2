"""What the command-line tools share: errors in one line (files are written whole or not at all
by :func:`swin_backbone.checkpoint.files.atomic_write`)."""
from __future__ import annotations


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (every run of whitespace, newlines included, one space)."""
    return " ".join(str(err).split())
