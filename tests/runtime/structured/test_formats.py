"""Date-format strings are exact calendar days: FULL_DATE against Python's calendar, and in the grammar."""

from __future__ import annotations

import datetime
import json
import re

import pytest
import xgrammar

from octavo.runtime.structured.formats import FULL_DATE, exact_formats
from octavo.runtime.structured.spec import StructuredOutputs


def is_calendar_day(text: str) -> bool:
    """RFC 3339 full-date as JSON Schema's date format checker reads it (datetime.date, years 1-9999)."""
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return bool(re.fullmatch(r"\d{4}-\d{2}-\d{2}", text))


@pytest.mark.parametrize("year", [1, 4, 100, 400, 1900, 2000, 2023, 2024, 9999])
def test_every_month_and_day_of_a_year_matches_exactly_when_it_is_a_day(year):
    for month in range(0, 14):
        for day in range(0, 33):
            text = f"{year:04d}-{month:02d}-{day:02d}"
            assert bool(re.fullmatch(FULL_DATE, text)) == is_calendar_day(text), text


def test_february_29_matches_exactly_in_leap_years():
    for year in range(0, 10000):
        text = f"{year:04d}-02-29"
        assert bool(re.fullmatch(FULL_DATE, text)) == is_calendar_day(text), text
    assert not re.fullmatch(FULL_DATE, "0000-01-01") and not re.fullmatch(FULL_DATE, "12024-01-01")


def test_date_schemas_get_the_pattern_others_are_kept():
    schema = {"type": "object", "properties": {
        "when": {"type": "string", "format": "date"},
        "history": {"type": "array", "items": {"format": "date"}},
        "maybe": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
        "own": {"type": "string", "format": "date", "pattern": "^2024-.*$"},
        "stamp": {"type": "string", "format": "date-time"}}}
    rewritten = json.loads(exact_formats(json.dumps(schema)))
    properties = rewritten["properties"]
    for date in (properties["when"], properties["history"]["items"], properties["maybe"]["anyOf"][0]):
        assert date == {"type": "string", "pattern": FULL_DATE}
    assert properties["maybe"]["anyOf"][1] == {"type": "null"}
    assert properties["own"] == schema["properties"]["own"] and properties["stamp"] == schema["properties"]["stamp"]
    unchanged = json.dumps({"type": "integer"}, separators=(",", ":"))
    assert exact_formats(unchanged) is unchanged


def test_the_grammar_refuses_days_the_calendar_lacks(grammars):
    spec = StructuredOutputs(json={"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
                                   "required": ["d"], "additionalProperties": False})
    grammar = grammars.compile(spec)
    for day, accepted in (("2024-02-29", True), ("2023-02-29", False), ("1900-02-29", False),
                          ("2000-02-29", True), ("2023-04-31", False), ("2023-12-31", True)):
        matcher = xgrammar.GrammarMatcher(grammar)
        text_ok = matcher.accept_string(f'{{"d": "{day}"}}')
        assert ((text_ok and matcher.is_terminated()) or text_ok) == accepted, day
