"""Streamed replies of a chat request with tools: text deltas become content or tool-call deltas.

One `ToolCallStream` per choice. By the plan's mode:

- none: every text delta is content;
- named: the reply is the function's arguments; the first delta opens the call (its index, id, type
  and name with the first piece of arguments), later ones carry more arguments;
- auto: text is content until the parser sees where a call may begin; from there it is held. When
  the choice finishes, the held text is parsed: each call is sent whole, as one delta (its index, id,
  type, name and all of its arguments: a chunk names each call once, so that a client that reads one
  delta per call per chunk misses nothing); text with no well-formed call is sent as content;
- required: everything is held and parsed when the choice finishes, likewise.

A client assembles each call by its `index`, concatenating the `arguments` pieces, as OpenAI's
streams are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.serve.tool_parsers import ParsedToolCalls
from octavo.serve.tools import ToolPlan, tool_call_id


@dataclass
class StreamPiece:
    """What one choice sends for one delta: content text and/or tool-call deltas."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class ToolCallStream:
    """The delta rewriting of one choice (see the module docstring)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content (or as arguments, named)
        self.called = False
        self._named_id: str | None = None

    def feed(self, delta: str) -> StreamPiece:
        """The piece to send for a new text delta of a running choice."""
        self.text += delta
        mode = self.plan.mode
        if mode == "none":
            return self._content_up_to(len(self.text))
        if mode == "named":
            return self._named_arguments()
        if mode == "auto":
            start = self.plan.parser.may_start_call(self.text)
            return self._content_up_to(len(self.text) if start is None else start)
        return StreamPiece()

    def finish(self) -> StreamPiece:
        """The piece to send when the choice finished: the held text, as calls or as content."""
        if self.plan.mode in ("none", "named"):
            return self._named_arguments() if self.plan.mode == "named" else self._content_up_to(len(self.text))
        parsed = self.plan.parse(self.text)
        if parsed is None:
            return self._content_up_to(len(self.text))
        return self._calls(parsed)

    def _content_up_to(self, end: int) -> StreamPiece:
        if end <= self.sent:
            return StreamPiece()
        piece = StreamPiece(self.text[self.sent:end])
        self.sent = end
        return piece

    def _named_arguments(self) -> StreamPiece:
        arguments = self.text[self.sent:]
        self.sent = len(self.text)
        if self._named_id is None:
            if not arguments:
                return StreamPiece()
            self._named_id = tool_call_id()
            self.called = True
            return StreamPiece(tool_calls=[{"index": 0, "id": self._named_id, "type": "function",
                                            "function": {"name": self.plan.function_name, "arguments": arguments}}])
        return StreamPiece(tool_calls=[{"index": 0, "function": {"arguments": arguments}}] if arguments else [])

    def _calls(self, parsed: ParsedToolCalls) -> StreamPiece:
        self.called = True  # the text before the calls (auto) went out as content as it came
        self.sent = len(self.text)
        return StreamPiece(tool_calls=[{"index": index, "id": tool_call_id(), "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments}}
                                       for index, call in enumerate(parsed.calls)])
