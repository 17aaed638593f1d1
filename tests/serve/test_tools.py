"""Tools and chat-template fields on `octavo serve`, against the tokenizer's own `apply_chat_template`.

tool_choice "none" renders tools into the prompt; tool choices that name no tool or an unknown one are 400
(the calls themselves: test_tool_calls.py); `chat_template_kwargs`, `add_generation_prompt` and
`continue_final_message` reach the template.

The tiny llama is compiled here with a chat template that renders tools and tool conversations (the
bundled model's template ignores both), so that a prompt with tools differs from one without. The
reference is that tokenizer's own `apply_chat_template`, given the tools and the messages in the
shape transformers documents (tool-call arguments as a dict).
"""

from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import artifact_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
# The same conversation as transformers' chat templates read it.
TEMPLATE_CONVERSATION = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
    {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


@pytest.fixture(scope="module")
def tokenizer(tool_artifact):
    return artifact_tokenizer(tool_artifact)


@pytest.fixture(scope="module")
def server(tool_server):
    return tool_server


def reference_ids(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def chat(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": server.model, "max_tokens": 4, "temperature": 0, **fields})


def test_tool_choice_none_renders_the_tools_into_the_prompt(server, tokenizer):
    expected = reference_ids(tokenizer, MESSAGES, [WEATHER])
    assert expected != reference_ids(tokenizer, MESSAGES, None)
    assert "get_weather" in tokenizer.decode(expected)
    response = chat(server, messages=MESSAGES, tools=[WEATHER], tool_choice="none", parallel_tool_calls=False)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["usage"]["prompt_tokens"] == len(expected)
    message = payload["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "tools": [WEATHER]}, timeout=60)
    assert tokenized.json()["tokens"] == expected


def test_an_explicit_null_tool_choice_is_none(server, tokenizer):
    expected = reference_ids(tokenizer, MESSAGES, [WEATHER])
    response = chat(server, messages=MESSAGES, tools=[WEATHER], tool_choice=None)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_a_tool_conversation_reaches_the_template_in_transformers_shape(server, tokenizer):
    expected = reference_ids(tokenizer, TEMPLATE_CONVERSATION, [WEATHER])
    assert '{"city": "Paris"}' in tokenizer.decode(expected)  # the arguments rendered as an object, not a string
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": CONVERSATION, "tools": [WEATHER]}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected
    response = chat(server, messages=CONVERSATION, tools=[WEATHER], tool_choice="none")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("fields", "message"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "does not match any of the specified `tools`"),
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": NAMED}, "When using `tool_choice`, `tools` must be set."),
])
def test_tool_choices_without_their_tool_are_400(server, fields, message):
    response = chat(server, messages=MESSAGES, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and message in error["message"], error


def test_tool_definitions_and_calls_are_validated(server):
    bad_tool = {"type": "function", "function": {"name": "has space"}}
    bad_call = {**CALL, "function": {"name": "get_weather", "arguments": "{not json"}}
    for fields, param in [
        ({"tools": [bad_tool], "tool_choice": "none"}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}], "tool_choice": "none"}, "tools.0.type"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [bad_call]}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0"),
    ]:
        response = chat(server, **{"messages": MESSAGES, **fields})
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["param"] == param, (fields, response.text)
    # "required" with no tools at all is "none", as OpenAI (and vLLM) take it.
    assert chat(server, messages=MESSAGES, tools=[], tool_choice="required").status_code == 200


def test_chat_template_kwargs_reach_the_template(server, tokenizer):
    expected = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                                              greeting="Hello from the test"),
                                add_special_tokens=False)
    assert expected != reference_ids(tokenizer, MESSAGES, None)
    response = chat(server, messages=MESSAGES, chat_template_kwargs={"greeting": "Hello from the test"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    tokenized = httpx.post(f"{server.url}/tokenize", timeout=60, json={
        "messages": MESSAGES, "chat_template_kwargs": {"greeting": "Hello from the test"}})
    assert tokenized.json()["tokens"] == expected


def test_chat_template_kwargs_may_not_set_how_the_template_is_applied(server):
    for key in ("tokenize", "chat_template", "add_generation_prompt"):
        response = chat(server, messages=MESSAGES, chat_template_kwargs={key: False})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template_kwargs" and key in error["message"], error


def test_a_chat_request_without_the_generation_prompt(server, tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    assert expected != reference_ids(tokenizer, MESSAGES, None)
    response = chat(server, messages=MESSAGES, add_generation_prompt=False)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    both = chat(server, messages=MESSAGES, continue_final_message=True)  # add_generation_prompt defaults to true
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", both.text


def test_a_chat_request_continues_the_final_message(server, tokenizer):
    prefilled = [*MESSAGES, {"role": "assistant", "content": "In Paris it is"}]
    rendered = tokenizer.apply_chat_template(prefilled, add_generation_prompt=False, continue_final_message=True,
                                             tokenize=False)
    assert rendered.endswith("In Paris it is")
    response = chat(server, messages=prefilled, add_generation_prompt=False, continue_final_message=True)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
