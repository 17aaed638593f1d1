"""Property-based fuzzing of request bodies: each body is valid or invalid by the OpenAI API's schema, and the
server answers 200 to every valid one and a 4xx naming a wrong field to every invalid one; no 500, no hang.

Bodies are a valid request with up to 4 fields replaced: half of the bodies by values drawn to be valid,
the others by values of every JSON type (in range, out of range, wrong type), with required fields
dropped, fields of the other endpoint and vLLM's unserved fields added, and raw bodies that are not JSON
objects. Texts range over all of Unicode, surrogates included, written as raw UTF-8 or as escapes (a lone
surrogate always as an escape, see json_text); numbers include the edges of their types (int64 and past
it, 1e308, 1e309, 5e-324, -0.0, NaN and Infinity literals, 5000 digits); values nest up to 100000 deep;
prompts reach the character bound on their length and bodies the request-size limit.

Which answer each body must get is decided by `openai_schema` (the schema written from the OpenAI API
reference, with the server's tokenizer for the prompt lengths), never by asking the server: 200 with a
well-formed completion; 400 naming a field the schema refuses; else 404 for an unknown model; else 400
naming a field a rule across fields refuses; 413 past the size limit; 400 for bodies that are no JSON
object. The default run is derandomized (the same bodies every time); OCTAVO_FUZZ_SEED=N (or "random")
draws other bodies and prints the seed to rerun them; OCTAVO_FUZZ_EXAMPLES=N sets how many. The counts of
requests and statuses are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from octavo.serve.context import DEFAULT_MAX_REQUEST_BYTES
from tests.serve.conftest import TINY_MAX_MODEL_LEN, artifact_tokenizer
from tests.serve.json_text import Literal, write_json
from tests.serve.openai_schema import ENDPOINTS, SERVICE_TIERS, schema_errors, semantic_errors
from tests.serve.server_process import scrape_metrics
from tests.tiny_models import VOCAB_SIZE

MAX_EXAMPLES = int(os.environ.get("OCTAVO_FUZZ_EXAMPLES", "250"))
SEED = os.environ.get("OCTAVO_FUZZ_SEED")
REQUEST_TIMEOUT_S = 60.0  # a request that takes longer is a hang
SERVED_MODEL = "test-model"

LONGEST_TOKEN_CHARS = 81  # the bundled tokenizer's longest token: prompts past 128 * 81 characters never fit

any_character = st.characters(exclude_categories=())  # every code point, surrogates included
edge_numbers = st.sampled_from([Literal(text) for text in (
    "NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1e309", "1.7976931348623157e308", "5e-324", "-0.0", "-0",
    "0.1e-400", "1E+2", "2.0", str(2**31), str(2**53 + 1), str(2**63 - 1), str(2**63), str(-(2**63)),
    str(-(2**63) - 1), str(2**64), "1" + "0" * 400, "9" * 5000)])
deep_nesting = st.sampled_from([Literal("[" * depth + "]" * depth) for depth in (64, 1000, 100_000)]
                               + [Literal('{"a":' * depth + "1" + "}" * depth) for depth in (64, 1000, 100_000)])
long_texts = st.sampled_from([TINY_MAX_MODEL_LEN * LONGEST_TOKEN_CHARS + delta for delta in (-1, 0, 1)]
                             + [50_000, 2**20]).map(lambda length: "x" * length)
texts = st.text(any_character, max_size=24) | long_texts
short_texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # valid Unicode, fits the context
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(), edge_numbers, st.text(any_character, max_size=12))
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(any_character, max_size=6), children, max_size=3),
                           max_leaves=6) | deep_nesting
plain_json = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(allow_nan=False,
                          allow_infinity=False) | short_texts,
                          lambda children: st.lists(children, max_size=3)
                          | st.dictionaries(short_texts, children, max_size=3), max_leaves=6)
token_ids = st.integers(min_value=0, max_value=VOCAB_SIZE - 1)

SCHEMAS = [  # real JSON schemas, the kinds tools and structured output send
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0},
                                      "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"type": "string", "enum": ["a", "b"]}, "ok": {"type": "boolean"}}},
    {"type": "object"},
    {},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    {"type": ["string", "null"], "maxLength": 8},
    {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    {"type": "string", "enum": ["yes", "no"]},
]
NOT_SCHEMAS = [  # a `type` that names no JSON Schema type, at the top or in a subschema
    {"type": "wat"}, {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "array", "items": {"type": 5}},
    {"type": ["string", "wat"]}, {"anyOf": [{"type": "integer"}, {"type": "int"}]},
    {"type": "object", "additionalProperties": {"type": "float"}},
]
SCHEMA_TEXTS = ["", "not json", "[1]", "1", "true", "false", '{"type": NaN}', '{"a": 1e999}', "[" * 5000 + "]" * 5000,
                '{"a":' * 2000 + "1" + "}" * 2000]
REGEXES = [r"[a-z]+", r"(yes|no)", r"\d{1,3}", r"a|b", "x", "🙂+", r"[^\n]{1,5}", r"(\w+ ){0,2}\w+"]
NOT_REGEXES = ["", "(ab", "[a-", "*a", "a{2,1}", "a**", "[]", "\\", "a)"]
schemas = st.sampled_from(SCHEMAS)
as_json_text = lambda value: write_json(value, escape=False)  # noqa: E731
not_a_string = json_values.filter(lambda value: not isinstance(value, str))
schema_values = st.sampled_from(NOT_SCHEMAS) | not_a_string.filter(lambda value: not isinstance(value, dict))
schema_names = st.sampled_from(["answer", "a-b_1", "x" * 64])
json_schema_formats = st.fixed_dictionaries(
    {"type": st.just("json_schema"),
     "json_schema": st.fixed_dictionaries({"name": schema_names, "schema": schemas},
                                          optional={"description": short_texts, "strict": st.booleans()})})
wild_response_formats = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"]) | json_values},
    optional={"json_schema": st.none() | st.fixed_dictionaries(
        {}, optional={"name": schema_names | st.sampled_from(["", "x" * 65, "a b", "é"]) | json_values,
                      "schema": schemas | schema_values | st.none(),
                      "description": texts | json_values, "strict": st.booleans() | json_values})})
stop_strings = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8)


TOOL_USE = "tools with tool_choice"
"""Not a field: `tools` and `tool_choice` drawn together (a tool choice is valid only with its tools)."""


def either(valid, wild):
    """(values drawn to be valid, values of any kind) for one field; None: no valid value (the field is left
    out of the bodies drawn to be valid)."""
    return valid, wild if valid is None else valid | wild


SHARED_FIELDS = {
    "model": either(st.sampled_from([SERVED_MODEL, None]), st.just("unknown-model") | json_values),
    "n": either(st.sampled_from([None, 1, 1, 2, 3, 128]),
                st.integers(min_value=-1, max_value=3) | st.integers(min_value=129) | json_values),
    "temperature": either(st.none() | st.floats(min_value=0.05, max_value=2) | st.just(1),
                          st.floats(min_value=-1, max_value=3) | st.just(0) | json_values),
    "top_p": either(st.none() | st.floats(min_value=0.05, max_value=1), st.floats(-0.5, 1.5) | edge_numbers
                    | json_values),
    "top_k": either(st.none() | st.integers(min_value=-1, max_value=60000),
                    st.integers(min_value=-3, max_value=60000) | json_values),
    "min_p": either(st.none() | st.floats(min_value=0, max_value=0.2), st.floats(-0.5, 1.5) | edge_numbers
                    | json_values),
    "presence_penalty": either(st.none() | st.floats(-2, 2), st.floats(-3, 3) | edge_numbers | json_values),
    "frequency_penalty": either(st.none() | st.floats(-2, 2), st.floats(-3, 3) | edge_numbers | json_values),
    "repetition_penalty": either(st.none() | st.floats(0.1, 2), st.floats(-1, 3) | json_values),
    "stop": either(st.none() | stop_strings | st.lists(stop_strings, min_size=1, max_size=4),
                   texts | st.lists(texts, max_size=6) | json_values),
    "stop_token_ids": either(st.none() | st.lists(token_ids, max_size=3),
                             st.lists(st.integers(min_value=-5, max_value=60000), max_size=3) | json_values),
    "seed": either(st.none() | st.integers(-(2**63), 2**63 - 1), st.integers() | edge_numbers | json_values),
    "stream": either(st.none() | st.booleans(), json_values),
    "stream_options": either(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values),
    "logit_bias": either(st.none() | st.dictionaries(token_ids.map(str), st.integers(-100, 100) | st.floats(-100, 100),
                                                     max_size=3),
                         st.dictionaries(st.integers(-5, 60000).map(str) | st.sampled_from(["abc", "5.0", " 5", ""])
                                         | texts, st.floats(-200, 200) | edge_numbers, max_size=3) | json_values),
    "ignore_eos": either(st.booleans(), json_values),
    "min_tokens": either(st.integers(0, 4), st.integers(-2, 200) | json_values),
    "user": either(st.none() | short_texts, texts | json_values),
    "metadata": either(st.none() | st.dictionaries(short_texts, short_texts, max_size=3),
                       st.dictionaries(st.text(max_size=70), st.text(max_size=3) | json_values, max_size=17)
                       | json_values),
    "service_tier": either(st.none() | st.sampled_from(SERVICE_TIERS), json_values),
    "best_of": either(st.sampled_from([None, 1, False]), st.integers(0, 3) | json_values),
    "response_format": either(st.none() | st.sampled_from([{"type": "text"}, {"type": "json_object"}])
                              | json_schema_formats, wild_response_formats | json_values),
    "guided_json": either(st.none() | schemas | schemas.map(as_json_text),
                          schema_values | schema_values.map(as_json_text) | st.sampled_from(SCHEMA_TEXTS)
                          | json_values),
    "guided_regex": either(st.none() | st.sampled_from(REGEXES), st.sampled_from(NOT_REGEXES) | not_a_string),
    "guided_choice": either(st.none() | st.lists(short_texts, min_size=1, max_size=3),
                            st.lists(st.text(any_character, max_size=24), max_size=3) | json_values),
    "guided_decoding_backend": either(st.sampled_from([None, "xgrammar", "auto"]),
                                      st.sampled_from(["outlines", "guidance", "lm-format-enforcer"]) | json_values),
    "unknown_field": either(plain_json, json_values),
}
prompts = either(short_texts.filter(bool) | st.lists(short_texts.filter(bool), min_size=1, max_size=3)
                 | st.lists(token_ids, min_size=1, max_size=12)
                 | st.lists(st.lists(token_ids, min_size=1, max_size=5), min_size=1, max_size=3),
                 texts | st.lists(st.integers(min_value=-10, max_value=60000), max_size=12)
                 | st.lists(texts, max_size=3)
                 | st.lists(st.lists(st.integers(min_value=-5, max_value=50000), max_size=5), max_size=3)
                 | json_values)
COMPLETION_FIELDS = {
    **SHARED_FIELDS,
    "prompt": prompts,
    "max_tokens": either(st.sampled_from([None, *range(0, 7)]), st.integers(-2, 6) | st.integers() | edge_numbers
                         | json_values),
    "logprobs": either(st.none() | st.integers(0, 20), st.integers(min_value=-1, max_value=25) | json_values),
    "echo": either(st.none() | st.booleans(), json_values),
    "suffix": either(st.sampled_from([None, ""]), texts | json_values),
    "messages": either(None, st.just([{"role": "user", "content": "Hi"}]) | json_values),  # chat's
}
tool_arguments = texts | st.sampled_from(['{"city": "Paris"}', "", '"\\ud800"', "[" * 5000 + "]" * 5000, "1" * 5000,
                                          "NaN", "  "])
tool_calls = st.fixed_dictionaries({"id": texts, "type": st.just("function") | json_values,
                                    "function": st.fixed_dictionaries({"name": texts, "arguments": tool_arguments})})
valid_tool_calls = st.lists(st.fixed_dictionaries({"id": short_texts, "type": st.just("function"),
                                                   "function": st.fixed_dictionaries({
                                                       "name": short_texts,
                                                       "arguments": st.sampled_from(['{"city": "Paris"}', ""])})}),
                            min_size=1, max_size=2)
tools = st.fixed_dictionaries({"type": st.just("function") | json_values, "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "", "x" * 65]) | texts},
    optional={"description": texts | json_values, "parameters": schemas | schema_values,
              "strict": st.booleans() | json_values})})
valid_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "a-b_1"])},
    optional={"description": short_texts, "parameters": schemas, "strict": st.booleans()})})
valid_tools = st.lists(valid_tool, max_size=2)
named_choices = st.sampled_from(["get_weather", "a-b_1"]).map(lambda name: {"type": "function",
                                                                          "function": {"name": name}})
tool_choices = st.sampled_from([None, "none", "auto", "required"]) | named_choices
valid_messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]),
                           "content": short_texts | st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": short_texts}), min_size=1, max_size=2)},
                          optional={"name": short_texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": short_texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": valid_tool_calls},
                          optional={"content": st.none() | short_texts}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": short_texts, "tool_call_id": short_texts})),
    min_size=1, max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | json_values},
    optional={"content": st.one_of(texts, st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2), json_values),
              "name": texts | json_values,
              "tool_calls": st.lists(tool_calls, max_size=2) | json_values,
              "tool_call_id": texts | json_values}), max_size=3)
CHAT_FIELDS = {
    **SHARED_FIELDS,
    "messages": either(valid_messages, messages | json_values),
    "max_tokens": either(st.sampled_from([None, *range(1, 7)]), st.integers(-2, 6) | st.integers() | json_values),
    "max_completion_tokens": either(st.sampled_from([None, *range(1, 7)]),
                                    st.integers(-2, 6) | st.integers() | json_values),
    "logprobs": either(st.none() | st.booleans(), json_values),
    "top_logprobs": either(st.none() | st.integers(0, 20), st.integers(min_value=-1, max_value=25) | json_values),
    "response_format": either(st.none() | st.just({"type": "text"}),
                              st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
                              | json_values),
    "tools": either(st.none() | valid_tools, st.lists(tools, max_size=2) | json_values),
    "tool_choice": either(st.sampled_from([None, "none"]), tool_choices | json_values),
    TOOL_USE: either(st.fixed_dictionaries({"tools": st.lists(valid_tool, min_size=1, max_size=2),
                                          "tool_choice": tool_choices}),
                     st.fixed_dictionaries({"tools": st.none() | valid_tools, "tool_choice": tool_choices})),
    "parallel_tool_calls": either(st.none() | st.booleans(), json_values),
    "prompt": either(None, st.just("Hi") | json_values),  # a parameter of /v1/completions
    "echo": either(None, json_values),  # another of /v1/completions
}
FIELDS = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}
BASES = {"/v1/completions": {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 4},
         "/v1/chat/completions": {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 4}}


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    """(endpoint, raw body): usually a body with up to 4 fields changed (half of the time by values drawn to be
    valid), sometimes no JSON object at all, invalid UTF-8, or a body just under or over the size limit."""
    endpoint = draw(st.sampled_from(sorted(BASES)))
    base, fields = BASES[endpoint], FIELDS[endpoint]
    kind = draw(st.sampled_from(["mutated"] * 16 + ["not_an_object"] * 2 + ["not_json"] * 2
                                + ["invalid_utf8", "at_the_size_limit"]))
    escape = draw(st.booleans())
    if kind == "not_json":
        return endpoint, draw(st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
    if kind == "not_an_object":
        return endpoint, write_json(draw(json_values), escape).encode()
    if kind == "at_the_size_limit":  # a valid request padded with JSON whitespace to the limit, or one byte past
        body = write_json(base, escape)
        size = DEFAULT_MAX_REQUEST_BYTES + draw(st.sampled_from([0, 1]))
        return endpoint, (" " * (size - len(body)) + body).encode()
    aim_valid = draw(st.booleans())
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        valid, anything = fields[name]
        if not (aim_valid and valid is None):
            value = draw(valid if aim_valid else anything)
            if name == TOOL_USE:
                body.update(value)
            else:
                body[name] = value
    if not aim_valid and draw(st.integers(0, 9)) == 0:
        del body[ENDPOINTS[endpoint][1]]
    raw = write_json(body, escape).encode()
    if kind == "invalid_utf8":  # bytes no UTF-8 decoder accepts, inside a string value
        bad = draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"]))
        raw = raw.replace(b'"model":"', b'"model":"' + bad, 1)
    return endpoint, raw


@dataclass(frozen=True)
class Expected:
    """The answer a body must get: its status, and for a 4xx the fields one of which the error must name
    (None: no field, as for a body that is no JSON object)."""

    status: int
    fields: frozenset[str] | None = None


class Judge:
    """Decides a raw body's expected answer from the schema (openai_schema) and the tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def expected(self, endpoint: str, raw: bytes) -> Expected:
        if len(raw) > DEFAULT_MAX_REQUEST_BYTES:
            return Expected(413)
        try:
            text = raw.decode("utf-8")
            if nesting_depth(text) >= PYTHON_JSON_MAX_DEPTH:
                return Expected(400)
            body = json.loads(text)
        except ValueError:  # invalid UTF-8, not JSON, or a number of more digits than Python reads
            return Expected(400)
        if not isinstance(body, dict):
            return Expected(400)
        refused = schema_errors(endpoint, body)
        if refused:
            return Expected(400, frozenset(refused))
        if body.get("model") not in (None, SERVED_MODEL):
            return Expected(404, frozenset({"model"}))
        lengths = self.prompt_lengths(endpoint, body)
        refused = semantic_errors(endpoint, body, lengths, VOCAB_SIZE, TINY_MAX_MODEL_LEN)
        if not all(map(self.writable, body.get("guided_choice") or [])):
            refused.add("guided_choice")  # a choice no token sequence writes can never be generated
        return Expected(400, frozenset(refused)) if refused else Expected(200)

    def writable(self, text: str) -> bool:
        """Whether the tokenizer writes `text` back exactly (a vocabulary without some byte drops it)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text

    def prompt_lengths(self, endpoint: str, body: dict) -> list[int]:
        """Token counts of the prompts (chat: of the conversation through the chat template)."""
        if endpoint == "/v1/chat/completions":
            return [len(self.tokenizer.apply_chat_template(
                [{"role": "system" if message["role"] == "developer" else message["role"],
                  "content": _message_text(message.get("content"))} for message in body["messages"]],
                tools=body.get("tools") or None, add_generation_prompt=True, tokenize=True, return_dict=False))]
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        return [len(item) if isinstance(item, list) else len(self.tokenizer.encode(item)) for item in prompt]


PYTHON_JSON_MAX_DEPTH = 1000
"""Python's JSON reader, under the default recursion limit, cannot read values nested this deep (the server's
400: not valid JSON); the bodies nest 64 deep (readable), 1000 or 100000 deep."""


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (not escaped and char == "\\"), in_string and (escaped or char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _message_text(content) -> str:
    """OpenAI's content: a string, text parts (concatenated) or, beside tool calls, null."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def check_response(response: httpx.Response, expected: Expected, body: bytes) -> None:
    context = (response.status_code, response.text[:500], body[:500], expected)
    assert response.status_code == expected.status, context
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], context
        if expected.fields is not None:
            named = (error["param"] or "").split(".")[0]
            assert named in expected.fields, context
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", context
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        payload = response.json()
        assert payload["choices"], context
        request = json.loads(body)
        if 0 in (request.get("max_tokens"), request.get("max_completion_tokens")):  # the prompt only, answered
            assert payload["usage"]["completion_tokens"] == 0, context
        else:
            assert payload["usage"]["completion_tokens"] >= len(payload["choices"]), context


def refusals_413(url: str, endpoint: str) -> float:
    """The server's count of 413 answers on `endpoint` (its /metrics)."""
    return scrape_metrics(url).get(f'octavo_http_requests_total{{endpoint="{endpoint}",status="413"}}', 0.0)


def _seeded(test):
    """With OCTAVO_FUZZ_SEED ("random": a new one), Hypothesis draws from that seed, printed so it can be rerun."""
    if SEED is None:
        return test
    value = random.randrange(2**32) if SEED == "random" else int(SEED)
    print(f"\nfuzzing with seed {value} (rerun: OCTAVO_FUZZ_SEED={value})")
    return seed(value)(test)


@pytest.fixture(scope="module")
def judge(tiny_llama_artifact) -> Judge:
    return Judge(artifact_tokenizer(tiny_llama_artifact))


def test_fuzzed_bodies_get_200_when_valid_and_a_4xx_naming_the_field_when_not(tiny_server, judge):
    statuses: Counter[int] = Counter()

    @_seeded
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(request_bodies())
    def send(request: tuple[str, bytes]) -> None:
        endpoint, body = request
        expected = judge.expected(endpoint, body)
        refused = refusals_413(tiny_server.url, endpoint) if expected.status == 413 else None
        with httpx.Client(base_url=tiny_server.url, timeout=REQUEST_TIMEOUT_S) as client:
            try:
                response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
            except httpx.TransportError:
                # The server answers 413 as soon as the headers declare too many bytes and closes the connection
                # unread; a client still sending its body can then lose the answer to the connection's reset
                # (TCP drops what the client had not yet read). The server's own count shows it answered 413.
                if expected.status != 413:
                    raise
                assert refusals_413(tiny_server.url, endpoint) == refused + 1, (endpoint, body[-200:])
                statuses[413] += 1
                return
        statuses[response.status_code] += 1
        check_response(response, expected, body)

    send()
    total = sum(statuses.values())
    print(f"\nfuzzing: {total} requests sent, statuses {dict(sorted(statuses.items()))}")
    assert statuses[200] >= total // 4 and statuses[400] >= total // 4, statuses  # both halves are exercised
    assert httpx.get(f"{tiny_server.url}/health", timeout=5).status_code == 200
    metrics = scrape_metrics(tiny_server.url)
    assert metrics["octavo_num_requests_running"] == metrics["octavo_num_requests_waiting"] == 0
    assert metrics["octavo_kv_blocks_used"] == 0  # every block free or merely cached
