"""Tool-call parsers on texts written in each family's format, and the streaming of calls out of text deltas.

Each parser's result is compared with the calls written into the text (names, and arguments as the
decoded JSON object); text with no well-formed call is None (the reply stays text).
"""

from __future__ import annotations

import json

import pytest

from octavo.serve.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    parser_for_template,
    tool_parser,
)
from octavo.serve.tool_stream import ToolCallStream
from octavo.serve.tools import ToolPlan

WEATHER_ARGS = {"city": "Paris", "days": 2}
TIME_ARGS = {"zone": "CET"}


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def test_hermes_blocks_with_content_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    parsed = HermesParser().parse(text)
    assert calls_of(parsed) == [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    assert parsed.content == "Let me check."
    # Arguments given as JSON text (some templates write them so) are read too.
    quoted = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>'
    assert calls_of(HermesParser().parse(quoted)) == [("get_time", TIME_ARGS)]


@pytest.mark.parametrize("text", [
    "no call at all",
    '<tool_call>{"name": "get_weather", "arguments": {broken}}</tool_call>',
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>not json</tool_call>',
])
def test_hermes_text_without_a_well_formed_call_stays_text(text):
    assert HermesParser().parse(text) is None


def test_llama3_json_calls():
    parser = Llama3JsonParser()
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    assert calls_of(parser.parse(one)) == [("get_weather", WEATHER_ARGS)]
    two = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}; {"name": "get_time", "parameters": ' \
          '{"zone": "CET"}}'
    assert calls_of(parser.parse(two)) == [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    for text in ("The weather is fine.", '{"name": "get_weather", "parameters": {"city": }', '{"city": "Paris"}',
                 '{"name": "get_time", "parameters": {}} and more'):
        assert parser.parse(text) is None, text


def test_mistral_calls_in_both_formats():
    parser = MistralParser()
    listed = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, ' \
             '{"name": "get_time", "arguments": {"zone": "CET"}}]'
    parsed = parser.parse(listed)
    assert calls_of(parsed) == [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    assert parsed.content == "Sure."
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    assert calls_of(parser.parse(named)) == [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    for text in ("[TOOL_CALLS] [{\"name\": 3}]", "[TOOL_CALLS]get_weather{}", "no calls"):
        assert parser.parse(text) is None, text


def test_the_parser_follows_the_chat_template():
    assert isinstance(parser_for_template("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}"), HermesParser)
    assert isinstance(parser_for_template("{{ '[TOOL_CALLS]' + tool_calls | tojson }}"), MistralParser)
    assert isinstance(parser_for_template("{%- if message.role == 'ipython' %}<|python_tag|>"), Llama3JsonParser)
    assert isinstance(parser_for_template(None), HermesParser)
    assert isinstance(tool_parser("mistral", "<tool_call>"), MistralParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'"):
        tool_parser("qwen", None)


def test_where_a_call_may_start():
    hermes = HermesParser()
    assert hermes.may_start_call("Hello") is None
    assert hermes.may_start_call("Hello <tool") == 6  # could still become the marker: held back
    assert hermes.may_start_call("Hello <tool_call>{") == 6
    llama = Llama3JsonParser()
    assert llama.may_start_call("  {\"na") == 0 and llama.may_start_call("<|pyth") == 0
    assert llama.may_start_call("Sunny, 18 C") is None


def feed_all(stream: ToolCallStream, deltas: list[str]) -> tuple[str, list[dict]]:
    content, tool_calls = "", []
    for delta in deltas:
        piece = stream.feed(delta)
        content, tool_calls = content + piece.content, tool_calls + piece.tool_calls
    piece = stream.finish()
    return content + piece.content, tool_calls + piece.tool_calls


def assemble(tool_calls: list[dict]) -> list[tuple[str, str, dict]]:
    """Calls from stream deltas, as an OpenAI client assembles them: by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    for delta in tool_calls:
        call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = delta.get("id", call["id"])
        call["name"] += delta.get("function", {}).get("name", "")
        call["arguments"] += delta.get("function", {}).get("arguments", "")
    return [(call["id"], call["name"], json.loads(call["arguments"])) for _, call in sorted(calls.items())]


def test_streamed_auto_replies_hold_calls_back_and_send_content():
    text = 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
    deltas = [text[index:index + 5] for index in range(0, len(text), 5)]  # the marker split over deltas
    stream = ToolCallStream(ToolPlan("auto", None, parser=HermesParser()))
    content, tool_calls = feed_all(stream, deltas)
    assert content == "Checking " and stream.called
    assert len(tool_calls) == 1, "the held call goes out whole, in one delta"
    [(call_id, name, arguments)] = assemble(tool_calls)
    assert call_id.startswith("chatcmpl-tool-") and (name, arguments) == ("get_weather", WEATHER_ARGS)
    # A malformed call is sent as content, all of it.
    broken = 'Checking <tool_call>{"name": "get_weather", "arguments": {oops</tool_call>'
    stream = ToolCallStream(ToolPlan("auto", None, parser=HermesParser()))
    assert feed_all(stream, [broken[:12], broken[12:]]) == (broken, []) and not stream.called


def test_streamed_named_calls_send_arguments_as_they_come():
    stream = ToolCallStream(ToolPlan("named", None, function_name="get_weather"))
    content, tool_calls = feed_all(stream, ['{"city": ', '"Paris", ', '"days": 2}'])
    assert content == "" and len(tool_calls) == 3 and "id" not in tool_calls[1]
    assert [(name, arguments) for _, name, arguments in assemble(tool_calls)] == [("get_weather", WEATHER_ARGS)]


def test_required_and_single_call_plans_parse_the_listed_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "get_time", ' \
           '"parameters": {"zone": "CET"}}]'
    assert calls_of(ToolPlan("required", None).parse(text)) == [("get_weather", WEATHER_ARGS),
                                                                 ("get_time", TIME_ARGS)]
    assert calls_of(ToolPlan("required", None, single_call=True).parse(text)) == [("get_weather", WEATHER_ARGS)]
    stream = ToolCallStream(ToolPlan("required", None))
    content, tool_calls = feed_all(stream, [text[:30], text[30:]])
    assert content == "" and [delta["index"] for delta in tool_calls] == [0, 1]  # each call whole, once
    assert [(name, arguments) for _, name, arguments in assemble(tool_calls)] == [("get_weather", WEATHER_ARGS),
                                                                                  ("get_time", TIME_ARGS)]
    assert ToolPlan("required", None).parse('[{"name": "get_weather"') is None
    assert ToolPlan("none", None).parse(text) is None
    assert ToolPlan("named", None, function_name="f").parse("{}").calls == [ParsedCall("f", "{}")]
