"""Structured output over HTTP: every spelling (OpenAI's response_format, vLLM's guided_* and structured_outputs)
constrains the reply, streamed or not; a constraint the grammar engine rejects is a 400 naming its field.

Replies are checked by independent definitions of each constraint: jsonschema, re.fullmatch, membership.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from tests.serve.server_process import stream_events

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Plan a trip"}], "max_tokens": 48,
        "temperature": 0}
COMPLETION = {"model": "test-model", "prompt": "Plan a trip", "max_tokens": 48, "temperature": 0}


def valid_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def one_layout_json(text: str) -> None:
    """Without any whitespace: the one layout Python's json.dumps writes (", " and ": ", nothing else)."""
    valid_json(text)
    assert text == json.dumps(json.loads(text), ensure_ascii=False), text


def json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


CASES = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA,
                                                                         "strict": True}}}, valid_json),
    ("chat", {"response_format": {"type": "json_object"}}, json_object),
    ("chat", {"guided_json": SCHEMA}, valid_json),
    ("completion", {"guided_json": json.dumps(SCHEMA)}, valid_json),
    ("completion", {"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{1,2}"},
     lambda text: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,2}", text) or pytest.fail(text)),
    ("completion", {"guided_choice": ["by train", "by boat", "on foot"]},
     lambda text: text in ("by train", "by boat", "on foot") or pytest.fail(text)),
    ("completion", {"guided_grammar": 'root ::= "go " ("north" | "south") "!"'},
     lambda text: re.fullmatch("go (north|south)!", text) or pytest.fail(text)),
    ("completion", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, one_layout_json),
    ("chat", {"structured_outputs": {"choice": ["yes", "no"]}, "guided_decoding_backend": "xgrammar"},
     lambda text: text in ("yes", "no") or pytest.fail(text)),
    ("completion", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, valid_json),
]


def reply(server, endpoint: str, fields: dict) -> tuple[str, str]:
    path, base = ("/v1/chat/completions", CHAT) if endpoint == "chat" else ("/v1/completions", COMPLETION)
    response = httpx.post(f"{server.url}{path}", json={**base, **fields}, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return (choice["message"]["content"] if endpoint == "chat" else choice["text"]), choice["finish_reason"]


@pytest.mark.parametrize(("endpoint", "fields", "check"), CASES,
                         ids=[f"{endpoint}-{next(iter(fields))}-{index}" for index, (endpoint, fields, _) in
                              enumerate(CASES)])
def test_every_spelling_constrains_the_reply(tiny_server, endpoint, fields, check):
    text, finish_reason = reply(tiny_server, endpoint, fields)
    assert finish_reason == "stop", text
    check(text)


def test_a_streamed_constrained_reply_is_the_same_text(tiny_server):
    expected, _ = reply(tiny_server, "chat", {"guided_json": SCHEMA})

    async def stream() -> list:
        async with httpx.AsyncClient(timeout=120) as client:
            return await stream_events(client, tiny_server.url, {**CHAT, "guided_json": SCHEMA, "stream": True},
                                       path="/v1/chat/completions")

    events = asyncio.run(stream())
    text = "".join(event["choices"][0]["delta"].get("content") or "" for event in events[:-1] if event["choices"])
    assert text == expected
    valid_json(text)


@pytest.mark.parametrize(("endpoint", "fields", "param", "message"), [
    ("completion", {"guided_regex": "(ab"}, "guided_regex", "parenthesis is not closed"),
    ("completion", {"guided_json": {"type": "wat"}}, "guided_json", 'Unsupported type "wat"'),
    ("completion", {"guided_json": "{not json"}, "guided_json", "not JSON"),
    ("chat", {"guided_grammar": "root ::= missing"}, "guided_grammar", 'Rule "missing" is not defined'),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "minItems": 2, "maxItems": 1}}}}, "response_format.json_schema.schema", "minItems"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type", "'json_schema'"),
    ("completion", {"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex", "lower bound"),
    ("completion", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("completion", {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " *"}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ("completion", {"guided_choice": []}, "guided_choice", "at least 1"),
    ("completion", {"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex", "only one kind"),
    ("chat", {"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
])
def test_rejected_constraints_are_400_naming_the_field(tiny_server, endpoint, fields, param, message):
    path, base = ("/v1/chat/completions", CHAT) if endpoint == "chat" else ("/v1/completions", COMPLETION)
    response = httpx.post(f"{tiny_server.url}{path}", json={**base, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200
