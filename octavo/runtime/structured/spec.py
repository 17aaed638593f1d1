"""What a request's output must match: one JSON schema, JSON object, regex, choice or EBNF grammar.

`StructuredOutputs` is `SamplingParams.structured`, vLLM's `StructuredOutputsParams` under Octavo's
name. Exactly one of its kinds is set:

- ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON value the schema accepts;
- ``json_object``: True for any JSON object (OpenAI's ``response_format: json_object``);
- ``regex``: the whole output matches the regular expression;
- ``choice``: the output is one of the strings, exactly;
- ``grammar``: the output is a sentence of the EBNF grammar (GBNF's syntax, start rule ``root``).

``disable_any_whitespace`` writes JSON in one layout (``", "`` and ``": "`` between items, no other
whitespace, as Python's ``json.dumps``) instead of allowing any whitespace between its tokens.
The grammar engine (xgrammar) compiles the spec once per distinct spec (`grammars.GrammarCache`);
a spec it cannot compile is a `GrammarError` naming the kind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from octavo.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarError(RequestError):
    """A structured-output spec the grammar engine rejects; `kind` is the spec kind (json, regex, ...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _fail(kind: str, requirement: str) -> GrammarError:
    return GrammarError(kind, f"SamplingParams.structured.{kind} must be {requirement}")


@dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint; see the module docstring. Validated (types, one kind) on construction."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    _key: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise RequestError("SamplingParams.structured needs exactly one of json, json_object, regex, choice, "
                               f"grammar; got {', '.join(chosen) or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _fail("disable_any_whitespace", "a bool")
        object.__setattr__(self, "_key", (chosen[0], self._canonical(chosen[0]), self.disable_any_whitespace))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return self._key[0]

    @property
    def key(self) -> tuple:
        """Hashable identity of the constraint: equal keys compile to the same grammar."""
        return self._key

    def _canonical(self, kind: str) -> Any:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as error:
                    raise _fail("json", f"a JSON schema; its text is not JSON: {error}") from None
            if not isinstance(value, dict | bool):
                raise _fail("json", f"a JSON schema (an object), got {type(value).__name__}")
            # Key order is kept: properties are generated in the order the schema lists them.
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if kind == "json_object":
            if value is not True:
                raise _fail("json_object", "True or False")
            return True
        if kind == "choice":
            if not isinstance(value, list | tuple) or not value or not all(isinstance(item, str) for item in value):
                raise _fail("choice", "a non-empty list of strings")
            return tuple(value)
        if not isinstance(value, str) or not value:
            raise _fail(kind, "a non-empty string")
        return value

    def schema_text(self) -> str:
        """The JSON schema as compact JSON text (json and json_object specs)."""
        if self.kind == "json_object":
            return '{"type":"object"}'
        return self._key[1]

    def choice_grammar(self) -> str:
        """An EBNF grammar whose sentences are exactly the choices."""
        return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in self.choice)

    @classmethod
    def of(cls, value: StructuredOutputs | dict | None) -> StructuredOutputs | None:
        """`value` as a StructuredOutputs: a dict is its keyword arguments."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {*KINDS, "disable_any_whitespace"})
            if unknown:
                raise RequestError(f"SamplingParams.structured has no field {unknown[0]!r}; the fields are "
                                   f"{', '.join((*KINDS, 'disable_any_whitespace'))}")
            return cls(**value)
        raise RequestError(f"SamplingParams.structured must be a StructuredOutputs or a dict, got "
                           f"{type(value).__name__}")
