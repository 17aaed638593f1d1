"""Which tool choices a chat request may make here, and the tools its chat template sees.

The server behaves like vLLM started without `--enable-auto-tool-choice` and `--tool-call-parser`:
it never parses tool calls out of the model's text and never constrains decoding to a tool's
schema. `tool_choice` "none" (the default without tools) passes the tool definitions to the chat
template, which renders them into the prompt, and the completion comes back as text (an explicit
null `tool_choice` is "none" too, as vLLM reads it). "auto" (OpenAI's default when tools are given
and `tool_choice` is absent), "required" and a named function would need one of those
two, so they are refused with a 400 that says so (vLLM refuses "auto" alike; it serves "required"
and named functions through guided decoding, which Octavo has not). As in vLLM, `tool_choice`
other than "none" needs `tools`, a named function must be one of them, and "required" with an
empty tool list is "none".
"""

from __future__ import annotations

from octavo.serve.errors import APIError
from octavo.serve.protocol import ChatCompletionRequest, tool_definitions

NOT_PARSED = ("this server does not parse tool calls from the model's output nor constrain decoding to them "
              "(vLLM needs --enable-auto-tool-choice and --tool-call-parser for this); send tool_choice \"none\" "
              "to have the tools passed to the chat template and the reply returned as text")


def template_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tool definitions for the chat template (None without tools), or a 400 for a choice not served here."""
    tools = body.tools
    choice = body.tool_choice
    if choice is None:  # absent: OpenAI's default; an explicit null reads as "none", as vLLM reads it
        choice = "auto" if tools and "tool_choice" not in body.model_fields_set else "none"
    if choice == "none":
        return tool_definitions(tools)
    if tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "required" and not tools:
        return None
    if not isinstance(choice, str):
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise APIError(400, f"The tool specified in `tool_choice` ({choice.function.name!r}) does not match "
                                f"any of the specified `tools` ({', '.join(names) or 'none'})", param="tool_choice")
        choice = "a named function"
    else:
        choice = f'"{choice}"'
    raise APIError(400, f"tool_choice {choice} is not supported: {NOT_PARSED}", param="tool_choice")
