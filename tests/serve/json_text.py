"""JSON text written by hand for the fuzzer: every string as raw UTF-8 or as escapes, literals verbatim.

`json.dumps` either escapes every non-ASCII character or writes raw text that cannot hold a lone
surrogate; a client may do either, and JSON can carry a lone surrogate only as an escape.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Literal:
    """JSON text written into the body as it is (a number literal, a deep nesting)."""

    text: str


def write_json(value, escape: bool) -> str:
    """The JSON text of `value`; with `escape`, every non-ASCII character as \\uXXXX (pairs past U+FFFF)."""
    if isinstance(value, Literal):
        return value.text
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return {math.inf: "Infinity", -math.inf: "-Infinity"}.get(value, repr(value))
    if isinstance(value, str):
        return write_string(value, escape)
    if isinstance(value, list):
        return "[" + ",".join(write_json(item, escape) for item in value) + "]"
    return "{" + ",".join(f"{write_string(str(key), escape)}:{write_json(item, escape)}"
                          for key, item in value.items()) + "}"


_MUST_ESCAPE = re.compile('["\\\\\x00-\x1f\ud800-\udfff]')
_NON_ASCII_OR_MUST_ESCAPE = re.compile('["\\\\\x00-\x1f\x7f-\U0010ffff]')


def write_string(text: str, escape: bool) -> str:
    """A JSON string; control characters and surrogates always escaped (they cannot be written raw)."""
    pattern = _NON_ASCII_OR_MUST_ESCAPE if escape else _MUST_ESCAPE
    return '"' + pattern.sub(_escaped, text) + '"'


def _escaped(match: re.Match) -> str:
    char = match.group()
    if char in '"\\':
        return "\\" + char
    code = ord(char)
    if code > 0xFFFF:  # a UTF-16 surrogate pair, as JSON spells characters past U+FFFF
        high, low = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
        return f"\\u{high:04x}\\u{low:04x}"
    return f"\\u{code:04x}"
