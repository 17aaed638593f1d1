"""JSON Schema string formats the grammar engine only approximates, given to it as exact patterns.

xgrammar turns ``"format": "date"`` into a pattern of four digits, a month 01-12 and a day 01-31,
so a model under it can write 2023-02-29, which no validator accepts (JSON Schema's date is RFC
3339's full-date: a real day of the proleptic Gregorian calendar, years 0001-9999 as Python's
`datetime.date` reads them). Before compiling, every string schema of format ``date`` that has no
pattern of its own is given `FULL_DATE` as its pattern instead: months of 31 and 30 days,
February of 28 days in every year and of 29 in leap years (divisible by 4, centuries only when
divisible by 400). The schema the request is validated against is left as sent.
"""

from __future__ import annotations

import json
from typing import Any

_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
              "|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
              "|02-(0[1-9]|1[0-9]|2[0-8]))")
FULL_DATE = f"^({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)$"
"""RFC 3339 full-date, exactly: every string it matches is a calendar day, and every day matches."""


def exact_formats(schema_text: str) -> str:
    """`schema_text` with each date-format string schema given `FULL_DATE` (module docstring)."""
    schema = json.loads(schema_text)
    rewritten = _rewrite(schema)
    return schema_text if rewritten == schema else json.dumps(rewritten, separators=(",", ":"))


def _rewrite(node: Any) -> Any:
    if isinstance(node, list):
        return [_rewrite(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _rewrite(value) for key, value in node.items()}
    if node.get("format") == "date" and "pattern" not in node and node.get("type", "string") == "string":
        node = {key: value for key, value in node.items() if key != "format"}
        node["type"], node["pattern"] = "string", FULL_DATE
    return node
