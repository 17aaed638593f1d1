"""Tool calls written by a model, in its family's format, read out of its text.

Each parser turns a finished completion into `ParsedToolCalls` (the calls, each a function name and
its arguments as JSON text, and the text around them), or None when the text holds no call in its
format or one that does not parse: such text is the assistant's reply as it stands (never an
error). The formats, as vLLM's parsers of the same names read them:

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call; text before the first block is the reply's content;
- `llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the whole reply is `{"name": ..., "parameters":
  {...}}` (or "arguments"), optionally after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (older templates),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (newer ones); text before the marker is content.

`may_start_call(text)` tells a streaming reader when to stop sending text as content: once the text
could be the beginning of a call, the rest is held until the completion ends and is parsed then.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedToolCalls:
    calls: list[ParsedCall]
    content: str | None  # the text beside the calls (None when there is none)


class ToolParser:
    """A model family's tool-call format; see the module docstring."""

    name = ""
    markers: tuple[str, ...] = ()  # texts a call starts with
    reads_special_tokens = False  # its marker is a special token: the reply is detokenized with them

    def parse(self, text: str) -> ParsedToolCalls | None:
        raise NotImplementedError

    def may_start_call(self, text: str) -> int | None:
        """Where in `text` a call may begin (a marker, or a prefix of one at the end); None: nowhere yet."""
        found = [index for index in (text.find(marker) for marker in self.markers) if index >= 0]
        if found:
            return min(found)
        for marker in self.markers:
            for length in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:length]):
                    return len(text) - length
        return None


def call_of(entry: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall | None:
    """A call from a decoded JSON entry {"name": str, <arguments key>: object or its JSON text}."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        return None
    key = next((key for key in arguments_keys if key in entry), None)
    arguments = entry.get(key, {}) if key is not None else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(entry["name"], json.dumps(arguments, ensure_ascii=False))


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedToolCalls | None:
        start = text.find("<tool_call>")
        if start < 0:
            return None
        calls = [call_of(_decode(body.strip())) for body in self._block.findall(text[start:])]
        if not calls or None in calls:
            return None
        return ParsedToolCalls(calls, text[:start].strip() or None)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    reads_special_tokens = True

    def may_start_call(self, text: str) -> int | None:
        # A call is the whole reply: only text that starts like one is held back.
        stripped = text.lstrip()
        if not stripped or "<|python_tag|>".startswith(stripped[:14]) or stripped.startswith(self.markers):
            return 0
        return None

    def parse(self, text: str) -> ParsedToolCalls | None:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return None
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                entry, end = decoder.raw_decode(body, position)
            except (ValueError, RecursionError):
                return None
            call = call_of(entry, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            position = len(body) - len(rest.removeprefix(";").lstrip())
        return ParsedToolCalls(calls, None) if calls else None


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    reads_special_tokens = True

    def parse(self, text: str) -> ParsedToolCalls | None:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return None
        body = text[start + len("[TOOL_CALLS]"):].strip()
        calls = self._json_list(body) if body.startswith(("[", "{")) else self._name_args(body)
        if not calls or None in calls:
            return None
        return ParsedToolCalls(calls, text[:start].strip() or None)

    @staticmethod
    def _json_list(body: str) -> list[ParsedCall | None] | None:
        entries = _decode(body)
        entries = [entries] if isinstance(entries, dict) else entries
        if not isinstance(entries, list):
            return None
        return [call_of(entry) for entry in entries]

    @staticmethod
    def _name_args(body: str) -> list[ParsedCall | None]:
        calls: list[ParsedCall | None] = []
        for piece in body.split("[TOOL_CALLS]"):
            name, separator, arguments = piece.partition("[ARGS]")
            if not separator:
                return [None]
            calls.append(call_of({"name": name.strip(), "arguments": arguments.strip()}))
        return calls


PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesParser, Llama3JsonParser,
                                                                           MistralParser)}


def parser_for_template(template: str | None) -> ToolParser:
    """The parser whose format the chat template writes tool calls in (hermes when it shows none)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonParser()
    return HermesParser()


def tool_parser(name: str, template: str | None) -> ToolParser:
    """The parser called `name`, or for "auto" the one the chat template suggests."""
    if name == "auto":
        return parser_for_template(template)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose auto or one of {', '.join(PARSERS)}")
    return PARSERS[name]()
