"""The hostile-input table's row type and its one assertion.

A row is a bad (or unusual) input and what must happen: an exception of a given type whose
message names the argument (or file) and what was expected, or the correct result (a check
that could fail). Each test file holds the rows of one part of the public surface.
"""
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple, Type

import pytest


@dataclass
class Row:
    id: str
    call: Callable[[], Any]
    error: Optional[Type[BaseException]] = None  # None: the call must succeed
    says: Sequence[str] = ()  # words the message must contain (the argument, what was expected)
    check: Optional[Callable[[Any], Any]] = None  # for a success: assert on the result

    def param(self):
        return pytest.param(self, id=self.id)


def bad(id: str, call: Callable[[], Any], error: Type[BaseException], *says: str) -> Row:
    return Row(id, call, error, says)


def good(id: str, call: Callable[[], Any], check: Optional[Callable[[Any], Any]] = None) -> Row:
    return Row(id, call, None, (), check)


def run_row(row: Row) -> None:
    if row.error is None:
        result = row.call()
        if row.check is not None:
            outcome = row.check(result)
            assert outcome is None or outcome, f"{row.id}: wrong result"
        return
    with pytest.raises(row.error) as info:
        row.call()
    message = str(info.value)
    for word in row.says:
        assert re.search(re.escape(word), message, re.IGNORECASE), f"{row.id}: {word!r} not in {message!r}"


def params(rows: Sequence[Row]) -> Tuple:
    ids = [r.id for r in rows]
    assert len(ids) == len(set(ids)), "row ids must be unique"
    return tuple(r.param() for r in rows)
