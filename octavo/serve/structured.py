"""Structured output on both endpoints: OpenAI's `response_format` and vLLM's guided-decoding fields.

A request asks for at most one constraint, spelled one of these ways (vLLM's spellings):

- `response_format`: `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}` (the schema is enforced, strict or not,
  as vLLM does); `{"type": "text"}` asks for nothing;
- `guided_json` (a schema, as an object or its JSON text), `guided_regex`, `guided_choice` (strings),
  `guided_grammar` (EBNF, GBNF's syntax, start rule `root`), `guided_decoding_backend` ("xgrammar" or
  "auto": the one engine served);
- `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...,
  "disable_any_whitespace": bool}`.

Two of them at once is a 400. The constraint is compiled on the tokenizer threads before the request
reaches the engine (and cached there by spec), so a schema, regex or grammar the grammar engine
rejects is a 400 that names the field it came in, and the engine thread never compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from octavo.errors import RequestError
from octavo.runtime.structured.spec import StructuredOutputs
from octavo.serve.errors import APIError
from octavo.serve.request_model import JsonObject, StrictModel, Text

SERVED_BACKENDS = ("xgrammar", "auto")


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: OpenAI's name, description, schema and strict."""

    name: Annotated[Text, Field(max_length=64)] | None = None
    description: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("a json_schema response format needs json_schema.schema")
        return self


class StructuredOutputsBody(StrictModel):
    """vLLM's `structured_outputs` object; what it cannot ask of xgrammar (a whitespace pattern, structural
    tags) is refused by name, its switches that change nothing here are accepted."""

    json_: JsonObject | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # xgrammar already reads a missing additionalProperties as false
    disable_fallback: bool = False  # there is one grammar engine: nothing to fall back to
    whitespace_pattern: Text | None = None
    structural_tag: Text | None = None

    @field_validator("whitespace_pattern", "structural_tag")
    @classmethod
    def _not_served(cls, value: Any, info) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by the grammar engine served here (xgrammar)")
        return value

    def spec(self) -> StructuredOutputs:
        return StructuredOutputs(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                 json_object=bool(self.json_object),
                                 disable_any_whitespace=self.disable_any_whitespace)


class StructuredOutputFields(StrictModel):
    """The request fields that ask for structured output (mixed into both endpoints' bodies)."""

    response_format: ResponseFormat | None = None
    guided_json: JsonObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None
    structured_outputs: StructuredOutputsBody | None = None

    @field_validator("guided_decoding_backend")
    @classmethod
    def _served_backend(cls, backend: str | None) -> str | None:
        if backend is not None and backend not in SERVED_BACKENDS:
            raise ValueError(f"the grammar engine served here is xgrammar; {backend!r} is not available")
        return backend


@dataclass(frozen=True)
class RequestedStructure:
    """The one constraint a request asked for, and the request field it came in (named by its errors)."""

    spec: StructuredOutputs
    field: str


def requested_structure(body: StructuredOutputFields) -> RequestedStructure | None:
    """The constraint `body` asks for (None: none); 400 for two at once or a malformed one."""
    asked = _asked(body)
    if len(asked) > 1:
        raise APIError(400, f"only one kind of structured output may be asked for at once; got "
                            f"{', '.join(field for field, _ in asked)}", param=asked[1][0])
    if not asked:
        return None
    field, build = asked[0]
    try:
        return RequestedStructure(build(), field)
    except RequestError as error:
        raise APIError(400, f"invalid {field}: {error}", param=field) from None


def _asked(body: StructuredOutputFields) -> list[tuple[str, Any]]:
    """(field, a function building its StructuredOutputs) for every constraint the body sets."""
    asked = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", lambda: StructuredOutputs(json_object=True)))
    if response_format is not None and response_format.type == "json_schema":
        asked.append(("response_format.json_schema.schema",
                      lambda: StructuredOutputs(json=response_format.json_schema.schema_)))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            asked.append((field, lambda kind=kind, value=value: StructuredOutputs(**{kind: value})))
    if body.structured_outputs is not None:
        spec = body.structured_outputs
        named = [kind for kind in ("json", "regex", "choice", "grammar") if getattr(spec, _attribute(kind))]
        field = f"structured_outputs.{named[0]}" if len(named) == 1 else "structured_outputs"
        asked.append((field, spec.spec))
    return asked


def _attribute(kind: str) -> str:
    return "json_" if kind == "json" else kind


async def compile_structure(context, requested: RequestedStructure | None) -> None:
    """Compile the constraint on a tokenizer thread (cached by the engine's grammar cache); 400 naming the
    request's field when the grammar engine rejects it."""
    if requested is None:
        return
    grammars = context.engine.engine.structured.grammars
    try:
        await context.encoder.run(lambda _tokenizer: grammars.compile(requested.spec))
    except RequestError as error:
        raise APIError(400, f"invalid {requested.field}: {error}", param=requested.field) from None
