"""Explicit JSON nulls for the fields the OpenAI API documents as nullable: accepted, and the same as leaving them out;
unknown fields ignored (and logged), vLLM fields the server does not serve refused by name.

Greedy requests with the nulls must give the same text, tokens and usage as the same request without them.
"""

from __future__ import annotations

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
