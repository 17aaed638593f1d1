"""Property-based fuzzing of request bodies: no 500, no hang, every rejection a 4xx OpenAI error with a message.

Bodies are valid requests with fields replaced by values of every JSON type (in range, out of range,
wrong type), required fields dropped, unknown fields added, and raw bodies that are not JSON objects.
Texts range over all of Unicode, surrogates included, written as raw UTF-8 or as escapes (a lone
surrogate always as an escape, see json_text); numbers include the edges of their types (int64 and
past it, 1e308, 1e309, 5e-324, -0.0, NaN and Infinity literals, 5000 digits); values nest up to
100000 deep; prompts reach the character bound on their length and bodies the request-size limit.
The counts of requests and statuses are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo.serve.context import DEFAULT_MAX_REQUEST_BYTES
from tests.serve.conftest import TINY_MAX_MODEL_LEN
from tests.serve.json_text import Literal, write_json
from tests.serve.server_process import scrape_metrics

# The default run is derandomized (same bodies, same counts every time); OCTAVO_FUZZ_EXAMPLES=N runs N random ones.
MAX_EXAMPLES = int(os.environ.get("OCTAVO_FUZZ_EXAMPLES", "250"))
DERANDOMIZE = "OCTAVO_FUZZ_EXAMPLES" not in os.environ
REQUEST_TIMEOUT_S = 60.0  # a request that takes longer is a hang

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
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(), edge_numbers, st.text(any_character, max_size=12))
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(any_character, max_size=6), children, max_size=3),
                           max_leaves=6) | deep_nesting
small_counts = st.integers(min_value=-2, max_value=6)
probabilities = st.floats(min_value=-0.5, max_value=1.5) | edge_numbers
penalties = st.floats(min_value=-3, max_value=3) | edge_numbers

SHARED_FIELDS = {
    "model": st.sampled_from(["test-model", "unknown-model"]) | json_values,
    "n": st.one_of(st.integers(min_value=-1, max_value=3), st.integers(min_value=129), json_values),
    "max_tokens": st.one_of(small_counts, st.integers(), edge_numbers, json_values),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), st.just(0), json_values),
    "top_p": probabilities | json_values,
    "top_k": st.one_of(st.integers(min_value=-3, max_value=60000), json_values),
    "min_p": probabilities | json_values,
    "presence_penalty": penalties | json_values,
    "frequency_penalty": penalties | json_values,
    "repetition_penalty": st.floats(min_value=-1, max_value=3) | json_values,
    "stop": st.one_of(texts, st.lists(texts, max_size=3), json_values),
    "stop_token_ids": st.lists(st.integers(min_value=-5, max_value=60000), max_size=3) | json_values,
    "seed": st.integers() | edge_numbers | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str) | texts, st.floats(-200, 200) | edge_numbers,
                                  max_size=3) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "min_tokens": small_counts | json_values,
    "user": texts | json_values,
    "unknown_field": json_values,
    **{  # structured output: every spelling, with schemas, regexes and grammars good and bad
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                                 optional={"json_schema": st.fixed_dictionaries(
                                                     {"name": texts}, optional={"schema": json_values,
                                                                                "strict": json_values})})
        | json_values,
        "guided_json": st.sampled_from([{"type": "object"}, {"type": "wat"}, {"enum": [1, "a"]}, '{"type": "string"}',
                                        "{not json"]) | json_values,
        "guided_regex": st.sampled_from(["[a-z]+", "(ab", "(?=a)", "\\d{2,1}", "a{99999}"]) | texts | json_values,
        "guided_choice": st.lists(texts, max_size=3) | json_values,
        "guided_grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= x", "root ::= (", ""]) | texts
        | json_values,
        "guided_decoding_backend": st.sampled_from(["xgrammar", "auto", "outlines"]) | json_values,
        "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object",
                                                               "disable_any_whitespace", "whitespace_pattern"]),
                                              json_values, max_size=2) | json_values,
    },
}
COMPLETION_FIELDS = {
    **SHARED_FIELDS,
    "prompt": st.one_of(texts, st.lists(st.integers(min_value=-10, max_value=60000), max_size=12),
                        st.lists(texts, max_size=3),
                        st.lists(st.lists(st.integers(min_value=-5, max_value=50000), max_size=5), max_size=3),
                        json_values),
    "logprobs": st.integers(min_value=-1, max_value=25) | json_values,
    "echo": st.booleans() | json_values,
    "suffix": texts | json_values,
}
tool_arguments = texts | st.sampled_from(['{"city": "Paris"}', "", '"\\ud800"', "[" * 5000 + "]" * 5000, "1" * 5000])
tool_calls = st.fixed_dictionaries({"id": texts, "type": st.just("function") | json_values,
                                    "function": st.fixed_dictionaries({"name": texts, "arguments": tool_arguments})})
tools = st.fixed_dictionaries({"type": st.just("function") | json_values, "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "", "x" * 65]) | texts},
    optional={"description": texts | json_values,
              "parameters": st.dictionaries(st.text(any_character, max_size=6), json_values, max_size=3)
              | st.sampled_from([{"type": "object", "properties": {"city": {"type": "string"}}}, {"type": "wat"}])
              | json_values,
              "strict": st.booleans() | json_values})})
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | json_values},
    optional={"content": st.one_of(texts, st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2), json_values),
              "name": texts | json_values,
              "tool_calls": st.lists(tool_calls, max_size=2) | json_values,
              "tool_call_id": texts | json_values}), max_size=3)
CHAT_FIELDS = {
    **SHARED_FIELDS,
    "messages": messages | json_values,
    "max_completion_tokens": st.one_of(small_counts, st.integers(), json_values),
    "logprobs": st.booleans() | json_values,
    "top_logprobs": st.integers(min_value=-1, max_value=25) | json_values,
    "tools": st.lists(tools, max_size=2) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}]) | json_values,
    "parallel_tool_calls": st.booleans() | json_values,
}
BASES = {
    "/v1/completions": ({"model": "test-model", "prompt": "Hello", "max_tokens": 4}, COMPLETION_FIELDS, "prompt"),
    "/v1/chat/completions": ({"model": "test-model", "messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 4}, CHAT_FIELDS, "messages"),
}


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    """(endpoint, raw body): usually a valid body with up to 4 fields changed, sometimes no JSON object at all,
    invalid UTF-8, or a body just under or over the size limit."""
    endpoint = draw(st.sampled_from(sorted(BASES)))
    base, fields, required = BASES[endpoint]
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
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 0:
        del body[required]
    raw = write_json(body, escape).encode()
    if kind == "invalid_utf8":  # bytes no UTF-8 decoder accepts, inside a string value
        bad = draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"]))
        raw = raw.replace(b'"model":"', b'"model":"' + bad, 1)
    return endpoint, raw


def check_response(response: httpx.Response, body: bytes) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500], body[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert 400 <= response.status_code < 500 and isinstance(error["message"], str) and error["message"]
        assert error["type"]
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        payload = response.json()
        assert payload["choices"] and payload["usage"]["completion_tokens"] >= len(payload["choices"])


def test_fuzzed_request_bodies_never_500_or_hang(tiny_server):
    statuses: Counter[int] = Counter()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request_bodies())
    def send(request: tuple[str, bytes]) -> None:
        endpoint, body = request
        with httpx.Client(base_url=tiny_server.url, timeout=REQUEST_TIMEOUT_S) as client:
            response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
        statuses[response.status_code] += 1
        check_response(response, body)

    send()
    total = sum(statuses.values())
    print(f"\nfuzzing: {total} requests sent, statuses {dict(sorted(statuses.items()))}")
    assert statuses[400] > 0 and statuses[200] > 0
    assert httpx.get(f"{tiny_server.url}/health", timeout=5).status_code == 200
    metrics = scrape_metrics(tiny_server.url)
    assert metrics["octavo_num_requests_running"] == metrics["octavo_num_requests_waiting"] == 0
    assert metrics["octavo_kv_blocks_used"] == 0  # every block free or merely cached
