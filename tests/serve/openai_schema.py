"""The request bodies of /v1/completions and /v1/chat/completions as the OpenAI API reference documents them
(plus vLLM's fields the server takes), written as checks: the fuzzer's split into valid and invalid bodies.

A body is read as a JSON reader reads it (Python's: `NaN` is a float, 5000 digits are unreadable). Then:

1. the schema (`schema_errors`): types, the documented ranges (OpenAI's: temperature 0..2, top_p 0..1,
   penalties -2..2, n 1..128, top_logprobs 0..20, logit_bias values -100..100, seed a signed 64-bit
   integer, stop 1 to 4 sequences, non-empty prompt lists; vLLM's where vLLM is stricter or adds a
   field: top_p > 0, top_k >= -1, min_p 0..1, repetition_penalty in (0, 2], completions' logprobs 0..20),
   the fields each message role requires, `stream_options` only with `stream: true`, a field of the
   other endpoint refused, vLLM's unserved best_of refused unless "off". Structured output's fields:
   `response_format` of type text, json_object or json_schema, whose `json_schema` has OpenAI's
   `name` (a function name's rule) and a `schema` object (vLLM decodes nothing without one);
   vLLM's `guided_json` (a schema object or its JSON text), `guided_regex`, `guided_choice` (a
   non-empty list of strings), `guided_decoding_backend` (only the served "xgrammar" or "auto").
   The server answers 400 naming one of the fields found here before anything else.
2. `model`: a name other than the served one is a 404.
3. the rules that need several fields, the vocabulary or the context (`semantic_errors`): sampling with
   n > 1, min_tokens <= max_tokens, stop strings not empty, token ids inside the vocabulary, a prompt
   that is not empty and that fits the context with its completion (chat: rendered with its tools),
   completions' `suffix` (not served), top_logprobs with logprobs, the tool choices (`tool_choice_error`),
   and structured output (`structure_errors`): one kind at most, a JSON schema that is one
   (`schema_error`), a regular expression that is one (`regex_error`), tools' `parameters` schemas, and
   no other structure beside a tool choice that decodes under the tools' schemas. Whether a
   `guided_grammar` or a `structured_outputs` object is valid is not decided here (only that it is
   one kind of structured output).

Each check returns None for a valid value, else why it is not. Nothing here imports the server.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], str | None]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SURROGATE = re.compile("[\ud800-\udfff]")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOKEN_ID_KEY = re.compile(r"[0-9]+")
ROLES = ("system", "developer", "user", "assistant", "tool")
ROLES_NEEDING_CONTENT = ("system", "developer", "user", "tool")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
UNSERVED = ("best_of",)
JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
SERVED_GRAMMAR_BACKENDS = ("xgrammar", "auto")
STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


# ---------------------------------------------------------------- value checks

def integer(low: int = INT64_MIN, high: int = INT64_MAX) -> Check:
    """A JSON integer literal (2.0 is not one: the server is strict) in [low, high]."""
    def check(value):
        if type(value) is not int:
            return "not an integer"
        return None if low <= value <= high else f"outside [{low}, {high}]"
    return check


def number(low: float, high: float, low_open: bool = False) -> Check:
    def check(value):
        if type(value) not in (int, float) or (type(value) is float and not math.isfinite(value)):
            return "not a finite number"
        if value < low or value > high or (low_open and value == low):
            return f"outside {'(' if low_open else '['}{low}, {high}]"
        return None
    return check


def boolean(value) -> str | None:
    return None if type(value) is bool else "not a boolean"


def text(value) -> str | None:
    if not isinstance(value, str):
        return "not a string"
    return "a lone surrogate" if SURROGATE.search(value) else None


def literal(*values) -> Check:
    return lambda value: None if isinstance(value, str) and value in values else f"not one of {values}"


def nullable(check: Check) -> Check:
    return lambda value: None if value is None else check(value)


def array(item: Check, min_items: int = 0, max_items: int | None = None) -> Check:
    def check(value):
        if not isinstance(value, list):
            return "not an array"
        if len(value) < min_items or (max_items is not None and len(value) > max_items):
            return f"{len(value)} items"
        return next((error for error in map(item, value) if error), None)
    return check


def one_of(*checks: Check) -> Check:
    def check(value):
        errors = [check(value) for check in checks]
        return None if None in errors else "; ".join(errors)
    return check


def obj(required: dict[str, Check] | None = None, optional: dict[str, Check] | None = None) -> Check:
    """A JSON object with these fields (others are ignored by the server, as unknown fields are)."""
    required, optional = required or {}, optional or {}

    def check(value):
        if not isinstance(value, dict):
            return "not an object"
        if any(SURROGATE.search(key) for key in value):
            return "a key with a lone surrogate"
        for name in required:
            if name not in value:
                return f"no {name}"
        for name, field in {**required, **optional}.items():
            if name in value and (error := field(value[name])):
                return f"{name}: {error}"
        return None
    return check


def json_object(value) -> str | None:
    """Any JSON object, whose keys and strings are text and whose numbers are finite."""
    return "not an object" if not isinstance(value, dict) else json_value(value)


def json_value(value) -> str | None:
    pending = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, str) and SURROGATE.search(node):
            return "a lone surrogate"
        if isinstance(node, float) and not math.isfinite(node):
            return "a number JSON cannot write"
        if isinstance(node, dict):
            if any(SURROGATE.search(key) for key in node):
                return "a key with a lone surrogate"
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return None


def metadata(value) -> str | None:
    error = json_object(value)
    if error or len(value) > 16:
        return error or "more than 16 pairs"
    if any(len(key) > 64 or not isinstance(item, str) or len(item) > 512 for key, item in value.items()):
        return "a key over 64 or a value over 512 characters, or a value that is not a string"
    return None


def logit_bias(value) -> str | None:
    if not isinstance(value, dict):
        return "not an object"
    for key, bias in value.items():
        if not TOKEN_ID_KEY.fullmatch(key):
            return f"key {key!r} is not a token id"
        if error := number(-100, 100)(bias):
            return error
    return None


def tool_arguments(value) -> str | None:
    """The arguments of a tool call: JSON text, or empty (whitespace)."""
    if error := text(value):
        return error
    if not value.strip():
        return None
    try:
        return json_value(json.loads(value))
    except (ValueError, RecursionError):
        return "not JSON the server can read"


def off(name: str, value) -> bool:
    """Whether an unserved vLLM field asks for nothing: null, false, empty, or best_of 1."""
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return name == "best_of" and type(value) in (int, float) and value == 1


def function_name(value) -> str | None:
    return text(value) or (None if FUNCTION_NAME.fullmatch(value) else "not a function name")


TOOL_CALL = obj({"id": text, "type": literal("function"),
                 "function": obj({"name": text, "arguments": tool_arguments})})
TEXT_PART = obj({"type": literal("text"), "text": text})
TOOL = obj({"type": literal("function"),
            "function": obj({"name": function_name},
                            {"description": nullable(text), "parameters": nullable(json_object),
                             "strict": nullable(boolean)})})
JSON_SCHEMA_FORMAT = obj({"name": function_name}, {"description": nullable(text), "schema": nullable(json_object),
                                                 "strict": nullable(boolean)})


def response_format(value) -> str | None:
    """OpenAI's text, json_object or json_schema; a json_schema format needs its schema, without which
    vLLM has nothing to decode under."""
    error = obj({"type": literal("text", "json_object", "json_schema")},
                {"json_schema": nullable(JSON_SCHEMA_FORMAT)})(value)
    if error:
        return error
    if value["type"] == "json_schema" and (value.get("json_schema") or {}).get("schema") is None:
        return "a json_schema format without json_schema.schema"
    return None


SUBSCHEMA_KEYWORDS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
SUBSCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")


def schema_error(schema) -> str | None:
    """Why `schema` is no JSON Schema a decoder can follow: not an object (true, the schema every value
    matches, is one; false matches none), or a `type` in it or its subschemas that is not one of JSON
    Schema's seven type names (or a list of them)."""
    if schema is True:
        return None
    if not isinstance(schema, dict):
        return "false: no value matches" if schema is False else "not a schema (an object)"
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue  # true / false subschemas, or a keyword's value of another kind (not read as a schema)
        kind = node.get("type")
        names = kind if isinstance(kind, list) else [kind]
        if "type" in node and not all(isinstance(name, str) and name in JSON_TYPES for name in names):
            return f"type {kind!r} is not a JSON Schema type"
        pending.extend(node.get(keyword) for keyword in SUBSCHEMA_KEYWORDS)
        for keyword in SUBSCHEMA_LIST_KEYWORDS:
            pending.extend(node.get(keyword) if isinstance(node.get(keyword), list) else [])
        for keyword in SUBSCHEMA_MAP_KEYWORDS:
            pending.extend(node.get(keyword).values() if isinstance(node.get(keyword), dict) else [])
    return None


def schema_text_error(value) -> str | None:
    """`guided_json`: a schema object, or JSON text of one (read as Python's JSON reader reads it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return "not JSON text"
        if error := json_value(value):
            return error
    return schema_error(value)


def regex_error(value) -> str | None:
    """Not a regular expression (checked with Python's `re`: the patterns the fuzzer draws are written in
    the syntax it shares with the ECMAScript-style regexes the server's grammar engine reads), or empty."""
    if not value:
        return "empty"
    try:
        re.compile(value)
    except re.error as error:
        return f"not a regular expression: {error}"
    return None


def message(value) -> str | None:
    """One chat message, with what its role requires (OpenAI's message types)."""
    if not isinstance(value, dict):
        return "not an object"
    role = value.get("role")
    if role not in ROLES:
        return f"role {role!r}"
    checks = {"name": nullable(text), "tool_calls": nullable(array(TOOL_CALL)), "tool_call_id": nullable(text),
              "content": nullable(one_of(text, array(TEXT_PART, min_items=1)))}
    error = obj(optional=checks)(value)
    if error:
        return error
    if value.get("tool_calls") is not None and role != "assistant":
        return "tool_calls outside an assistant message"
    if role == "tool" and value.get("tool_call_id") is None:
        return "a tool message without tool_call_id"
    if value.get("tool_call_id") is not None and role != "tool":
        return "tool_call_id outside a tool message"
    if value.get("content") is None and (role in ROLES_NEEDING_CONTENT or not value.get("tool_calls")):
        return f"a {role} message without content"
    return None


# ---------------------------------------------------------------- the two endpoints

SHARED = {
    "model": nullable(text),
    "n": nullable(integer(1, 128)),
    "temperature": nullable(number(0, 2)),
    "top_p": nullable(number(0, 1, low_open=True)),
    "top_k": nullable(integer(-1)),
    "min_p": nullable(number(0, 1)),
    "presence_penalty": nullable(number(-2, 2)),
    "frequency_penalty": nullable(number(-2, 2)),
    "repetition_penalty": nullable(number(0, 2, low_open=True)),
    "stop": nullable(one_of(text, array(text, min_items=1, max_items=4))),
    "stop_token_ids": nullable(array(integer(0))),
    "seed": nullable(integer()),
    "stream": nullable(boolean),
    "stream_options": nullable(obj(optional={"include_usage": boolean})),
    "logit_bias": nullable(logit_bias),
    "ignore_eos": boolean,
    "min_tokens": integer(0),
    "user": nullable(text),
    "metadata": nullable(metadata),
    "store": nullable(boolean),
    "service_tier": nullable(literal(*SERVICE_TIERS)),
    "response_format": nullable(response_format),
    "guided_json": nullable(one_of(json_object, text)),
    "guided_regex": nullable(text),
    "guided_choice": nullable(array(text, min_items=1)),
    "guided_decoding_backend": nullable(literal(*SERVED_GRAMMAR_BACKENDS)),
}
COMPLETION = {
    **SHARED,
    "prompt": one_of(text, array(text, min_items=1), array(integer(0), min_items=1),
                     array(array(integer(0), min_items=1), min_items=1)),
    "max_tokens": nullable(integer(0)),
    "logprobs": nullable(integer(0, 20)),
    "echo": nullable(boolean),
    "suffix": nullable(text),
}
CHAT = {
    **SHARED,
    "messages": array(message, min_items=1),
    "max_tokens": nullable(integer(1)),
    "max_completion_tokens": nullable(integer(1)),
    "logprobs": nullable(boolean),
    "top_logprobs": nullable(integer(0, 20)),
    "tools": nullable(array(TOOL)),
    "tool_choice": nullable(one_of(literal("none", "auto", "required"),
                                   obj({"type": literal("function"), "function": obj({"name": function_name})}))),
    "parallel_tool_calls": nullable(boolean),
    "functions": lambda value: None if value is None else "deprecated",
    "function_call": lambda value: None if value is None else "deprecated",
}
ENDPOINTS = {"/v1/completions": (COMPLETION, "prompt"), "/v1/chat/completions": (CHAT, "messages")}
OTHER_ENDPOINT = {"/v1/completions": "/v1/chat/completions", "/v1/chat/completions": "/v1/completions"}


def schema_errors(endpoint: str, body: dict) -> set[str]:
    """The top-level fields whose values the schema refuses (a required one missing counts too)."""
    fields, required = ENDPOINTS[endpoint]
    other = ENDPOINTS[OTHER_ENDPOINT[endpoint]][0]
    bad = {required} if required not in body else set()
    for name, value in body.items():
        if SURROGATE.search(name):
            bad.add(name)
        elif name in fields:
            if fields[name](value) is not None:
                bad.add(name)
        elif name in other:
            bad.add(name)  # a parameter of the other endpoint
        elif name in UNSERVED and not off(name, value):
            bad.add(name)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        bad.add("stream_options")  # "Only set this when you set stream: true"
    return bad


# ---------------------------------------------------------------- rules across fields (after the schema)

def semantic_errors(endpoint: str, body: dict, prompt_lengths: list[int], vocab_size: int,
                    context_tokens: int) -> set[str]:
    """Fields named by the rules that need several fields, the vocabulary or the context (see the module
    docstring); `prompt_lengths` are the prompts' token counts (chat: the rendered conversation's)."""
    bad = set()
    temperature = body.get("temperature")
    if (body.get("n") or 1) > 1 and temperature is not None and temperature == 0:
        bad.add("n")  # greedy sampling has one answer
    stop = body.get("stop")
    if stop == "" or (isinstance(stop, list) and "" in stop):
        bad.add("stop")
    if any(int(key) >= vocab_size for key in body.get("logit_bias") or {}):
        bad.add("logit_bias")
    if any(token >= vocab_size for token in body.get("stop_token_ids") or []):
        bad.add("stop_token_ids")
    if endpoint == "/v1/completions":
        max_tokens = body.get("max_tokens", 16)
        if body.get("suffix"):
            bad.add("suffix")
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (int, list)):
            token_lists = [prompt] if isinstance(prompt[0], int) else prompt
            if any(token >= vocab_size for tokens in token_lists for token in tokens):
                bad.add("prompt")
        length_fields = {"prompt", "max_tokens"}
        tool_structure = False
    else:
        max_tokens = body.get("max_completion_tokens")
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            bad.add("top_logprobs")
        if tool_choice_error(body):
            bad.add("tool_choice")
        if any(schema_error(tool["function"]["parameters"]) for tool in body.get("tools") or []
               if tool["function"].get("parameters") is not None):
            bad.add("tools")  # every tool's parameters must be a schema, whatever the choice
        length_fields = {"messages", "max_tokens", "max_completion_tokens"}
        tool_structure = not tool_choice_error(body) and decodes_under_tools(body)
    bad |= structure_errors(body, tool_structure)
    for length in prompt_lengths:
        if length == 0:
            bad.add("prompt")
        limit = context_tokens - length if max_tokens is None else max_tokens
        # max_tokens 0 (completions) shows nothing generated, but the prompt runs as a request for one token.
        if length + max(limit, 1) > context_tokens:
            bad.update(length_fields)
        elif body.get("min_tokens", 0) > limit:
            bad.add("min_tokens")
    return bad


def structured_fields(body: dict) -> list[str]:
    """The fields that ask for structured output (a text response_format asks for nothing)."""
    asked = [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    if (body.get("response_format") or {}).get("type") in ("json_object", "json_schema"):
        asked.append("response_format")
    return asked


def structure_errors(body: dict, tool_structure: bool) -> set[str]:
    """One kind of structured output at most, valid (a grammar or a structured_outputs object is not judged),
    and none beside a tool choice that decodes under the tools' schemas (`tool_structure`)."""
    asked = structured_fields(body)
    if len(asked) > 1 or (asked and tool_structure):
        return set(asked)
    kind = asked[0] if asked else None
    if kind == "response_format" and body["response_format"]["type"] == "json_schema":
        return {kind} if schema_error(body[kind]["json_schema"]["schema"]) else set()
    if kind == "guided_json":
        return {kind} if schema_text_error(body[kind]) else set()
    if kind == "guided_regex":
        return {kind} if regex_error(body[kind]) else set()
    return set()


def _tool_choice(body: dict):
    """tool_choice as served: absent, "auto" with (non-empty) tools and "none" without; null, "none" (as vLLM
    reads it); "required" with an empty tool list, "none" (nothing to call)."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    return "none" if choice is None or (choice == "required" and tools == []) else choice


def tool_choice_error(body: dict) -> str | None:
    """As OpenAI and vLLM answer: a choice other than "none" needs `tools`, and a named function must be
    one of them."""
    choice, tools = _tool_choice(body), body.get("tools")
    if choice == "none":
        return None
    if tools is None:
        return "a tool choice without tools"
    if isinstance(choice, dict) and choice["function"]["name"] not in [tool["function"]["name"] for tool in tools]:
        return "a named function that is not among the tools"
    return None


def decodes_under_tools(body: dict) -> bool:
    """Whether the reply is decoded under the tools' schemas: "required" (a list of calls) or a named
    function (its arguments), which no other structured output can be combined with."""
    choice = _tool_choice(body)
    return choice == "required" or isinstance(choice, dict)
