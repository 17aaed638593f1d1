"""Tool calls through the official `openai` client against `octavo serve` (the tiny llama with a hermes template).

"required" and named choices decode under the tools' schemas, so even random weights call the tools; every
call's arguments must validate against its tool's parameters (jsonschema). With "auto" the reply is read by
the hermes parser: the reply is forced into a well-formed or a malformed `<tool_call>` block with a regex
(vLLM's `structured_outputs`), which must become `tool_calls` or stay text. A round trip sends the call and
its result back, and the prompt must be what the chat template renders for that conversation.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.conftest import artifact_tokenizer

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast of a city",
                                            "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris for two days?"}]
FORCED_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
MALFORMED_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}</tool_call>'


def regex_for(text: str) -> str:
    return "".join("\\" + char if char in "{}[]()\\.*+?|^$" else char for char in text)


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, tool_server, **fields):
    return client.chat.completions.create(model=tool_server.model, **{
        "temperature": 0, "max_tokens": 64, "messages": MESSAGES, "tools": [WEATHER, TIME], **fields})


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    schema = {"get_weather": PARAMETERS, "get_time": TIME["function"]["parameters"]}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def streamed(client, tool_server, **fields) -> tuple[str, dict[int, dict], str]:
    """(content, calls by index assembled from the deltas, finish_reason) of a streamed request."""
    content, calls, finish_reason = "", {}, None
    for chunk in create(client, tool_server, stream=True, **fields):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] += (piece.function.name or "") if piece.function else ""
            call["arguments"] += (piece.function.arguments or "") if piece.function else ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return content, calls, finish_reason


def test_a_tool_round_trip(client, tool_server, tool_artifact):
    first = create(client, tool_server, tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    call = choice.message.tool_calls[0]
    conversation = [*MESSAGES, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = create(client, tool_server, messages=conversation, tool_choice="none", max_tokens=8)
    assert second.choices[0].message.tool_calls is None and isinstance(second.choices[0].message.content, str)
    tokenizer = artifact_tokenizer(tool_artifact)
    as_template_reads_it = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                      "arguments": json.loads(c.function.arguments)}}
        for c in choice.message.tool_calls]}, conversation[-1]]
    rendered = tokenizer.apply_chat_template(as_template_reads_it, tools=[WEATHER, TIME], add_generation_prompt=True,
                                             tokenize=False)
    assert call.id in rendered
    assert second.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_a_named_function_is_called_and_streamed_as_deltas(client, tool_server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = create(client, tool_server, tool_choice=named)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "stop"
    check_call(call)
    content, calls, finish_reason = streamed(client, tool_server, tool_choice=named)
    assert content == "" and finish_reason == "stop"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("chatcmpl-tool-")


def test_auto_reads_a_call_out_of_the_text_streamed_or_not(client, tool_server):
    forced = {"structured_outputs": {"regex": regex_for(FORCED_CALL)}}
    reply = create(client, tool_server, tool_choice="auto", extra_body=forced)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    content, calls, finish_reason = streamed(client, tool_server, extra_body=forced)  # "auto" is the default
    assert content == "" and finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather",
                                                                                 {"city": "Paris", "days": 2})]


def test_a_malformed_call_comes_back_as_text(client, tool_server):
    forced = {"structured_outputs": {"regex": regex_for(MALFORMED_CALL)}}
    reply = create(client, tool_server, tool_choice="auto", extra_body=forced)
    choice = reply.choices[0]
    assert choice.message.content == MALFORMED_CALL and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    content, calls, finish_reason = streamed(client, tool_server, extra_body=forced)
    assert (content, calls, finish_reason) == (MALFORMED_CALL, {}, "stop")


def test_one_call_when_parallel_calls_are_off(client, tool_server):
    reply = create(client, tool_server, tool_choice="required", parallel_tool_calls=False)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_tools_whose_parameters_are_no_schema_are_400_naming_the_tool(client, tool_server):
    for parameters, message in [({"type": "wat"}, 'Unsupported type "wat"'),
                                ({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}, "Cannot find")]:
        bad = {"type": "function", "function": {"name": "broken", "parameters": parameters}}
        with pytest.raises(openai.BadRequestError) as caught:
            create(client, tool_server, tools=[WEATHER, bad], tool_choice="none")
        error = caught.value.body
        assert error["param"] == "tools.1.function.parameters" and message in error["message"], error
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, tool_server, tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.body["param"] == "response_format"
    assert create(client, tool_server, tool_choice="none", max_tokens=2).choices[0].message.content is not None
