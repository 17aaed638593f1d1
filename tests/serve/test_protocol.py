"""Explicit JSON nulls for the fields the OpenAI API documents as nullable: accepted, and the same as leaving them out;
unknown fields ignored (and logged), vLLM fields the server does not serve refused by name.

Greedy requests with the nulls must give the same text, tokens and usage as the same request without them.
"""

from __future__ import annotations

import json

import httpx
import pytest

COMPLETION = {"model": "test-model", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
        "temperature": 0}
COMPLETION_NULLS = ["n", "echo", "logprobs", "suffix", "stop", "seed", "stream", "stream_options", "logit_bias",
                    "top_p", "presence_penalty", "frequency_penalty", "user", "metadata", "store", "service_tier"]
CHAT_NULLS = ["n", "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools", "tool_choice",
              "parallel_tool_calls", "functions", "function_call", "stop", "seed", "stream", "stream_options",
              "logit_bias", "top_p", "presence_penalty", "frequency_penalty", "user", "metadata", "store",
              "service_tier"]


def answer(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    payload = response.json()
    return {"choices": payload["choices"], "usage": payload["usage"]}


@pytest.mark.parametrize(("path", "base", "nullable"), [("/v1/completions", COMPLETION, COMPLETION_NULLS),
                                                       ("/v1/chat/completions", CHAT, CHAT_NULLS)])
def test_nulls_are_the_defaults(tiny_server, path, base, nullable):
    expected = answer(tiny_server, path, base)
    assert expected["usage"]["completion_tokens"] == 6
    assert answer(tiny_server, path, {**base, **dict.fromkeys(nullable)}) == expected


def test_a_nullable_field_keeps_its_type_and_range(tiny_server):
    for path, base, field, value in [("/v1/completions", COMPLETION, "n", 0),
                                     ("/v1/completions", COMPLETION, "echo", 1),
                                     ("/v1/chat/completions", CHAT, "logprobs", "yes"),
                                     ("/v1/chat/completions", CHAT, "parallel_tool_calls", 1),
                                     ("/v1/completions", COMPLETION, "ignore_eos", None)]:
        response = httpx.post(f"{tiny_server.url}{path}", json={**base, field: value}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)


def test_deprecated_function_fields_are_refused_unless_null(tiny_server):
    for field, value, newer in [("functions", [{"name": "f"}], "tools"), ("function_call", "auto", "tool_choice")]:
        response = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**CHAT, field: value}, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field, response.text
        assert "deprecated" in error["message"] and f"`{newer}`" in error["message"]


def test_unknown_fields_change_nothing_and_are_logged(tiny_server):
    """Fields the server does not know (a newer API version's, or the rest of an OpenAI response message sent back
    as the next turn's history) are ignored, as vLLM ignores them, and the server's log names them."""
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"},
               {"role": "user", "content": "Again"}]
    echoed = {"role": "assistant", "content": "Hi!", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}
    expected = answer(tiny_server, "/v1/chat/completions", {**CHAT, "messages": history})
    with_unknown = {**CHAT, "messages": [history[0], echoed, history[2]], "prompt_cache_key": "session-1",
                    "reasoning_effort": "low"}
    assert answer(tiny_server, "/v1/chat/completions", with_unknown) == expected
    assert answer(tiny_server, "/v1/completions", {**COMPLETION, "safety_identifier": "u1"}) == \
        answer(tiny_server, "/v1/completions", COMPLETION)
    log = tiny_server.log()
    for name in ("prompt_cache_key", "reasoning_effort", "refusal", "annotations", "audio", "safety_identifier"):
        assert f"'{name}'" in log and "ignoring unknown field" in log, name


def test_unserved_vllm_fields_set_to_off_are_ignored(tiny_server):
    """Their "off" values (what clients send by default) ask for nothing: ignored like any unknown field."""
    off = {"guided_json": None, "use_beam_search": False, "best_of": 1, "length_penalty": 1.0, "bad_words": [],
           "allowed_token_ids": None, "logits_processors": []}
    assert answer(tiny_server, "/v1/completions", {**COMPLETION, **off}) == answer(tiny_server, "/v1/completions",
                                                                                   COMPLETION)


@pytest.mark.parametrize(("path", "base", "field", "value"), [
    ("/v1/chat/completions", CHAT, "guided_whitespace_pattern", r"\s*"),
    ("/v1/completions", COMPLETION, "best_of", 2),
    ("/v1/chat/completions", CHAT, "chat_template", "{{ messages[0]['content'] }}"),
    ("/v1/completions", COMPLETION, "use_beam_search", True),
    ("/v1/completions", COMPLETION, "prompt_logprobs", 1),
    ("/v1/completions", COMPLETION, "allowed_token_ids", [1, 2, 3]),
])
def test_unserved_vllm_fields_are_refused_by_name(tiny_server, path, base, field, value):
    """vLLM's fields that would change the answer and that this server does not serve are a 400 naming them, not
    an answer without them."""
    response = httpx.post(f"{tiny_server.url}{path}", json={**base, field: value}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field, response.text
    assert f"'{field}'" in error["message"] and "does not serve" in error["message"], error["message"]


def test_content_parts_other_than_text_are_refused_by_type(tiny_server):
    """An image (or audio) part is a 400 that names its type: the served models read text only."""
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    response = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60,
                          json={**CHAT, "messages": [{"role": "user", "content": parts}]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages.0.content", response.text
    assert "'image_url'" in error["message"] and "text only" in error["message"], error["message"]



# ---- what the OpenAI API's schema requires, refused with a 400 that names the field

@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user"}, "messages.0.content"),
    ({"role": "system", "content": None}, "messages.0.content"),
    ({"role": "developer"}, "messages.0.content"),
    ({"role": "tool", "tool_call_id": "call_1"}, "messages.0.content"),
    ({"role": "tool", "content": "22 C"}, "messages.0.tool_call_id"),
    ({"role": "assistant"}, "messages.0.content"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "messages.0.content"),
    ({"role": "user", "content": []}, "messages.0.content"),
])
def test_a_message_without_what_its_role_requires_is_refused_naming_the_field(tiny_server, message, param):
    response = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**CHAT, "messages": [message]}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, response.text
    assert error["message"].startswith(("Missing required parameter: ", f"Invalid '{param}'")), error["message"]


def test_an_assistant_message_with_tool_calls_needs_no_content(tiny_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}]
    answer(tiny_server, "/v1/chat/completions", {**CHAT, "messages": messages})


@pytest.mark.parametrize(("path", "base", "field", "value", "owner"), [
    ("/v1/completions", COMPLETION, "messages", [{"role": "user", "content": "Hi"}], "/v1/chat/completions"),
    ("/v1/completions", COMPLETION, "max_completion_tokens", 4, "/v1/chat/completions"),
    ("/v1/completions", COMPLETION, "top_logprobs", None, "/v1/chat/completions"),
    ("/v1/completions", COMPLETION, "tools", [], "/v1/chat/completions"),
    ("/v1/chat/completions", CHAT, "prompt", "Hello", "/v1/completions"),
    ("/v1/chat/completions", CHAT, "echo", False, "/v1/completions"),
    ("/v1/chat/completions", CHAT, "suffix", None, "/v1/completions"),
])
def test_a_parameter_of_the_other_endpoint_is_refused_by_name(tiny_server, path, base, field, value, owner):
    """Sent to the wrong endpoint, a parameter would be ignored silently: a 400 names it and where it belongs."""
    response = httpx.post(f"{tiny_server.url}{path}", json={**base, field: value}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field, response.text
    assert f"'{field}' is a parameter of {owner}" in error["message"], error["message"]


@pytest.mark.parametrize(("field", "value", "message", "code"), [
    ("temperature", 3, "Invalid 'temperature': integer above maximum value. Expected a value <= 2, but got 3 instead.",
     "integer_above_max_value"),
    ("top_p", 1.5, "Invalid 'top_p': decimal above maximum value. Expected a value <= 1, but got 1.5 instead.",
     "decimal_above_max_value"),
    ("top_p", 0, "Invalid 'top_p': integer below minimum value. Expected a value > 0, but got 0 instead.",
     "integer_below_min_value"),
    ("presence_penalty", -2.5, "Invalid 'presence_penalty': decimal below minimum value. Expected a value >= -2, "
     "but got -2.5 instead.", "decimal_below_min_value"),
    ("n", 129, "Invalid 'n': integer above maximum value. Expected a value <= 128, but got 129 instead.",
     "integer_above_max_value"),
    ("stop", ["a", "b", "c", "d", "e"], "Invalid 'stop': array too long. Expected an array with maximum length 4, "
     "but got an array with length 5 instead.", "array_above_max_length"),
    ("stop", [], "Invalid 'stop': empty array. Expected an array with minimum length 1, but got an empty array "
     "instead.", "empty_array"),
    ("metadata", {"k" * 65: "v"}, f"Invalid 'metadata.{'k' * 65}': string too long. Expected a string with "
     "maximum length 64, but got a string with length 65 instead.",
     "string_above_max_length"),
])
def test_a_value_outside_its_documented_range_is_refused_in_openais_words(tiny_server, field, value, message, code):
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={**COMPLETION, field: value}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"].split(".")[0] == field, response.text
    assert (error["message"], error["code"]) == (message, code)


def test_messages_must_not_be_empty_in_openais_words(tiny_server):
    response = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**CHAT, "messages": []}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "empty_array", response.text
    assert error["message"] == ("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an "
                                "empty array instead.")


@pytest.mark.parametrize(("path", "base", "field", "value"), [
    ("/v1/completions", COMPLETION, "stream_options", {"include_usage": True}),
    ("/v1/chat/completions", CHAT, "service_tier", "premium"),
    ("/v1/completions", COMPLETION, "prompt", []),
    ("/v1/completions", COMPLETION, "prompt", [[1, 2], []]),
    ("/v1/completions", COMPLETION, "logit_bias", {" 5": 1}),
    ("/v1/chat/completions", CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {
        "x": float("nan")}}}]),
])
def test_other_values_the_schema_refuses(tiny_server, path, base, field, value):
    """stream_options without stream: true; a service tier OpenAI does not name; an empty prompt list; a logit_bias
    key that is not a token id's digits; NaN, which JSON cannot write, inside a tool's JSON schema."""
    response = httpx.post(f"{tiny_server.url}{path}", content=json.dumps({**base, field: value}), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"].split(".")[0] == field, response.text
