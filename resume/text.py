"""Values quoted in messages, bounded: whatever a checkpoint holds is untrusted input.

``repr()`` of a value read from a file can take forever (a pickle's shared tuple graph
64 levels deep is a few hundred bytes and 2**64 nodes when printed), recurse past the
interpreter's limit (a list nested 200,000 deep), or fail (``str()`` of an int of more
than 4,300 digits raises ValueError). Every message that quotes such a value goes
through ``short`` or ``number``, and an exception's own text through ``clip``: bounded in
size, depth and time, and never raising.
"""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any

__all__ = ["clip", "number", "parse_json", "short"]

_MAX_DIGITS = 40
"""Integers with more digits are described by their length, not printed."""


def number(value: int) -> str:
    """``value`` as digits, or "a 4291-digit number" when it has more than 40 digits."""
    if -(10 ** _MAX_DIGITS) < value < 10 ** _MAX_DIGITS:
        return str(value)
    digits = int(abs(value).bit_length() * math.log10(2))
    if abs(value) >= 10 ** digits:  # the estimate is low by at most one
        digits += 1
    return f"a {digits}-digit {'negative ' if value < 0 else ''}number"


class _Bounded(reprlib.Repr):
    """reprlib with small limits, big ints by their length, and any other object by its type
    name (its own ``__repr__`` may walk an unbounded structure)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 6
        self.maxdeque = self.maxarray = 6
        self.maxstring = max(20, limit)
        self.maxlong = 40
        self.maxother = 40

    def repr_int(self, x: int, level: int) -> str:
        return number(x)

    def repr_float(self, x: float, level: int) -> str:
        return repr(x)

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[: self.maxstring]) + ("..." if len(x) > self.maxstring else "")

    def repr_instance(self, x: Any, level: int) -> str:
        if x is None or isinstance(x, (bool, complex)):
            return repr(x)
        return f"<{type(x).__name__}>"


def clip(text: str, limit: int = 200) -> str:
    """Message text (an exception's own message, which may quote what it read) as plain text
    on one line: cut to ``limit`` characters, anything unprintable shown as ``?``; unquoted."""
    cut = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return cut if len(text) <= limit else cut + "..."


def short(value: Any, limit: int = 120) -> str:
    """A bounded ``repr`` of ``value``: at most ``limit`` characters, never raising."""
    try:
        text = _Bounded(limit).repr(value)
    except Exception:  # noqa: BLE001 - a message must not fail: an odd object is named by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_json(data: bytes | str) -> Any:
    """``data`` parsed as JSON. ValueError, with a bounded one-line reason, for anything else:
    not UTF-8, not JSON, NaN or Infinity, or nested past the parser's depth."""
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("expected JSON, actual one nested too deep to parse") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"expected JSON, actual {clip(str(e), 120)}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")
