"""What the command-line tools share: errors in one line, and argparse types that check a value as the
Python API does (files are written whole or not at all by :func:`swin_backbone.checkpoint.files.atomic_write`)."""
from __future__ import annotations

import argparse
from functools import partial
from typing import Any, Callable, Optional

from ..validation import check_int, check_number


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (every run of whitespace, newlines included, one space)."""
    return " ".join(str(err).split())


def arg_type(kind: Callable[[str], Any], check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)``, then ``check(value)`` (a :mod:`swin_backbone.validation` check), whose
    "expected ..., got ..." argparse prints after the option's name."""
    def parse(text: str) -> Any:
        value = kind(text)  # a ValueError here: argparse's own "invalid int value: 'x'"
        try:
            check(value)
        except ValueError as err:  # "name: expected ..., got ...": argparse names the option instead
            raise argparse.ArgumentTypeError(str(err).split(": ", 1)[-1]) from None
        return value

    parse.__name__ = kind.__name__  # (the word argparse puts in "invalid ... value")
    return parse


def int_arg(minimum: Optional[int] = None, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An int option in ``[minimum, maximum]``."""
    return arg_type(int, partial(check_int, "", minimum=minimum, maximum=maximum))


def number_arg(positive: bool = False) -> Callable[[str], float]:
    """A finite number option (``> 0`` if ``positive``)."""
    return arg_type(float, partial(check_number, "", positive=positive))
