"""A request field's violated bound, missing field or other endpoint's field, worded as the OpenAI API words it.

OpenAI answers a number out of range with ``Invalid 'temperature': decimal above maximum value.
Expected a value <= 2, but got 3 instead.`` (code ``decimal_above_max_value``), a list too long with
``array too long. Expected an array with maximum length 4, but got an array with length 5 instead.``
(``array_above_max_length``), and a required field left out with ``Missing required parameter:
'messages.0.content'.`` (``missing_required_parameter``). `openai_wording` gives (message, code) for
pydantic's errors of those kinds, None for any other (whose reason is pydantic's own).
"""

from __future__ import annotations

import json
from typing import Any

_BOUNDS = {"less_than_equal": ("le", "<=", "above maximum"), "less_than": ("lt", "<", "above maximum"),
           "greater_than_equal": ("ge", ">=", "below minimum"), "greater_than": ("gt", ">", "below minimum")}
PREFERRED_ERROR_TYPES = frozenset({*_BOUNDS, "too_long", "too_short", "string_too_long", "string_too_short",
                                   "missing_for_role", "value_error"})
"""Errors that say what is wrong with a value of the right type: reported before a union member's type mismatch."""


def openai_wording(error: dict, field: str) -> tuple[str, str] | None:
    """(message, code) in OpenAI's words for a bound, length or missing-field error of `field`, else None."""
    kind, context, value = error.get("type"), error.get("ctx") or {}, error.get("input")
    if kind in _BOUNDS:
        key, relation, side = _BOUNDS[kind]
        number = "integer" if isinstance(value, int) else "decimal"
        code = f"{number}_{side.split()[0]}_{'max' if side.startswith('above') else 'min'}_value"
        return (f"Invalid '{field}': {number} {side} value. Expected a value {relation} {_number(context[key])}, "
                f"but got {_number(value)} instead.", code)
    if kind in ("too_long", "too_short") and not isinstance(value, str):
        return _length_wording(field, kind == "too_long", context, value)
    if kind in ("string_too_long", "string_too_short", "too_long", "too_short"):
        longer = kind.endswith("too_long")
        bound = context["max_length" if longer else "min_length"]
        return (f"Invalid '{field}': string too {'long' if longer else 'short'}. Expected a string with "
                f"{'maximum' if longer else 'minimum'} length {bound}, but got a string with length {len(value)} "
                f"instead.", f"string_{'above_max' if longer else 'below_min'}_length")
    if kind == "missing":
        return f"Missing required parameter: '{field}'.", "missing_required_parameter"
    if kind == "missing_for_role":
        return f"Missing required parameter: '{field}' ({error['msg']}).", "missing_required_parameter"
    return None


def _length_wording(field: str, longer: bool, context: dict, value: Any) -> tuple[str, str]:
    what = "object" if isinstance(value, dict) else "array"
    size = "properties" if what == "object" else "length"
    actual = context.get("actual_length", len(value) if hasattr(value, "__len__") else "?")
    if not longer and actual == 0:
        return (f"Invalid '{field}': empty {what}. Expected an {what} with minimum {size} "
                f"{context['min_length']}, but got an empty {what} instead.", f"empty_{what}")
    bound = context["max_length" if longer else "min_length"]
    return (f"Invalid '{field}': {what} too {'long' if longer else 'short'}. Expected an {what} with "
            f"{'maximum' if longer else 'minimum'} {size} {bound}, but got an {what} with {size} {actual} instead.",
            f"{what}_{'above_max' if longer else 'below_min'}_{size}")


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return json.dumps(value) if isinstance(value, (int, float)) else repr(value)
