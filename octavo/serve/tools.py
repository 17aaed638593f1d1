"""Tool calling on /v1/chat/completions: what the chat template sees, what decoding must follow, what is parsed.

`tool_choice` decides, as in vLLM (with auto tool choice enabled):

- "none" (the default without tools; an explicit null too): the tools reach the chat template, the
  reply is text and is not parsed;
- "auto" (OpenAI's default with tools): the tools reach the template, decoding is free, and the
  reply is read by the server's tool-call parser (`tool_parsers`); calls found become `tool_calls`
  (finish_reason "tool_calls"), a reply with no well-formed call stays text;
- "required": decoding follows a JSON schema of a non-empty list of `{"name", "parameters"}` objects,
  one alternative per tool, each with that tool's parameter schema; every entry becomes a call;
- a named function: decoding follows that function's parameter schema; the reply is its arguments.

"required" and named choices are enforced by the grammar engine, not asked of the model, in JSON of
one layout (no whitespace but after "," and ":": arguments for a program, not for reading). A tool's
`parameters` must be a schema the grammar engine accepts, whatever the choice (400 naming the tool
otherwise). As in vLLM, a choice other than "none" needs `tools`, a named function must be one of
them, and "required" with an empty tool list is "none". `parallel_tool_calls: false` keeps one call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from octavo.errors import RequestError
from octavo.runtime.structured.spec import StructuredOutputs
from octavo.serve.errors import APIError
from octavo.serve.protocol import ChatCompletionRequest, Tool, tool_definitions
from octavo.serve.structured import RequestedStructure, compile_structure
from octavo.serve.tool_parsers import ParsedCall, ParsedToolCalls, ToolParser

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: `mode` none | auto | required | named."""

    mode: str
    template_tools: list[dict] | None
    structure: RequestedStructure | None = None
    function_name: str | None = None
    parser: ToolParser | None = None
    single_call: bool = False

    def parse(self, text: str) -> ParsedToolCalls | None:
        """The calls in a finished reply (None: the reply is text)."""
        if self.mode == "auto":
            parsed = self.parser.parse(text)
        elif self.mode == "named":  # the reply is the arguments, as decoded (and as streamed)
            parsed = ParsedToolCalls([ParsedCall(self.function_name, text)], None)
        elif self.mode == "required":
            parsed = _listed_calls(text)
        else:
            return None
        if parsed is not None and self.single_call:
            parsed = ParsedToolCalls(parsed.calls[:1], parsed.content)
        return parsed


def tool_plan(body: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
    """The plan of `body` (see the module docstring); 400 for a choice that cannot be served."""
    tools, choice = body.tools, body.tool_choice
    if choice is None:  # absent: OpenAI's default; an explicit null reads as "none", as vLLM reads it
        choice = "auto" if tools and "tool_choice" not in body.model_fields_set else "none"
    template_tools = tool_definitions(tools)
    single = body.parallel_tool_calls is False
    if choice == "none":
        return ToolPlan("none", template_tools)
    if tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        return ToolPlan("auto", template_tools, parser=parser, single_call=single)
    if choice == "required":
        if not tools:
            return ToolPlan("none", None)
        spec = StructuredOutputs(json=required_schema(tools, single), disable_any_whitespace=True)
        return ToolPlan("required", template_tools, RequestedStructure(spec, "tool_choice"), single_call=single)
    names = [tool.function.name for tool in tools]
    if choice.function.name not in names:
        raise APIError(400, f"The tool specified in `tool_choice` ({choice.function.name!r}) does not match "
                            f"any of the specified `tools` ({', '.join(names) or 'none'})", param="tool_choice")
    tool = tools[names.index(choice.function.name)]
    spec = StructuredOutputs(json=tool.function.parameters or ANY_OBJECT, disable_any_whitespace=True)
    return ToolPlan("named", template_tools, RequestedStructure(spec, "tool_choice"), tool.function.name)


def required_schema(tools: list[Tool], single: bool) -> dict:
    """JSON schema of a non-empty list of calls {"name": one tool's name, "parameters": its arguments}."""
    alternatives = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [tool.function.name]},
        "parameters": tool.function.parameters or ANY_OBJECT}, "required": ["name", "parameters"],
        "additionalProperties": False} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if single:
        schema["maxItems"] = 1
    return schema


async def check_tool_schemas(context, tools: list[Tool] | None) -> None:
    """400 naming the first tool whose `parameters` the grammar engine rejects (compiled on a tokenizer
    thread, and cached there for the "required" and named choices that decode under them)."""
    for index, tool in enumerate(tools or []):
        if tool.function.parameters is None:
            continue
        field = f"tools.{index}.function.parameters"
        try:
            spec = StructuredOutputs(json=tool.function.parameters)
        except RequestError as error:
            raise APIError(400, f"invalid {field}: {error}", param=field) from None
        await compile_structure(context, RequestedStructure(spec, field))


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call_entry(call: ParsedCall, call_id: str) -> dict:
    """A call as OpenAI's message.tool_calls lists it."""
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _listed_calls(text: str) -> ParsedToolCalls | None:
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entries, list) or not entries:
        return None
    calls = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            return None
        arguments = entry.get("parameters", {})
        if not isinstance(arguments, dict):
            return None
        calls.append(ParsedCall(entry["name"], json.dumps(arguments, ensure_ascii=False)))
    return ParsedToolCalls(calls, None)
