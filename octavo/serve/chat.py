"""POST /v1/chat/completions: messages through the artifact's chat template, streamed or not.

A streamed choice starts with a `{"role": "assistant", "content": ""}` delta, carries `content`
(or `tool_calls`) deltas, and ends with an empty delta holding its `finish_reason`, as OpenAI
streams do. Tools reach the chat template; `tool_choice` decides whether the reply is parsed for
tool calls or decoded under a grammar (`octavo.serve.tools`, `octavo.serve.tool_stream`).
Structured output (`response_format`, vLLM's guided fields) is in `octavo.serve.structured`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from octavo.runtime.outputs import RequestOutput
from octavo.serve.admission import check_prompt_chars, sampling_params
from octavo.serve.context import Generation, ServerContext
from octavo.serve.errors import APIError
from octavo.serve.logprobs import chat_logprobs
from octavo.serve.protocol import ChatCompletionRequest
from octavo.serve.sse import respond
from octavo.serve.stream import SampleDelta
from octavo.serve.structured import compile_structure, requested_structure
from octavo.serve.tokenization import EncodedPrompt, render_chat
from octavo.serve.tool_stream import ToolCallStream
from octavo.serve.tools import ToolPlan, check_tool_schemas, tool_call_entry, tool_call_id, tool_plan

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    context: ServerContext = request.app.state.context
    lora = context.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    plan = tool_plan(body, context.tool_parser)
    structure = requested_structure(body)
    if plan.structure is not None:
        if structure is not None:
            raise APIError(400, f"tool_choice {plan.mode!r} decodes under the tools' schemas; it cannot be combined "
                                f"with {structure.field}", param=structure.field)
        structure = plan.structure
    params = sampling_params(body, body.effective_max_tokens(), num_top,
                             structured=structure.spec if structure is not None else None)
    if plan.mode == "auto" and plan.parser.reads_special_tokens:
        params.skip_special_tokens = False  # its call marker is a special token, which would be dropped
    messages = body.template_messages()
    tools = plan.template_tools
    await check_tool_schemas(context, body.tools)
    await compile_structure(context, structure)

    def check_text(rendered: str) -> None:
        check_prompt_chars(rendered, context.character_bound, context.capacity, params.max_tokens, "messages")

    def encode(tokenizer) -> list[EncodedPrompt]:
        return [render_chat(tokenizer, messages, check_text, tools=tools,
                            add_generation_prompt=body.add_generation_prompt,
                            continue_final_message=body.continue_final_message,
                            add_special_tokens=body.add_special_tokens,
                            template_kwargs=body.chat_template_kwargs)]

    generation = await context.admit(1, params, encode, arrival, prompt_field="messages", lora=lora)
    writer = ChatWriter(context, generation, body, num_top, plan)
    return await respond(request, generation, bool(body.stream), writer.chunks,
                         lambda finals: writer.response(finals[0]))


class ChatWriter:
    """Builds the response objects (streamed chunks or one body) of one chat completion request."""

    def __init__(self, context: ServerContext, generation: Generation, body: ChatCompletionRequest,
                 num_top: int | None, plan: ToolPlan):
        self.generation = generation
        self.plan = plan
        self._tool_streams: dict[int, ToolCallStream] = {}
        self.id = f"chatcmpl-{generation.base_id}"
        self.created = int(time.time())
        self.model = body.model or context.settings.model_name
        self.num_top = num_top
        self.include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        self._started: set[int] = set()

    def response(self, final: RequestOutput) -> dict:
        choices = []
        for completion in final.outputs:
            message, finish_reason = self._message(completion.text, completion.finish_reason)
            choices.append({"index": completion.index, "message": message,
                            "logprobs": self._logprobs(completion.logprobs, completion.token_ids),
                            "finish_reason": finish_reason, "stop_reason": completion.stop_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(final)}

    async def chunks(self) -> AsyncIterator[dict]:
        while not self.generation.finished:
            _, delta = await self.generation.next_output()
            for sample in delta.samples:
                for choice in self._stream_choices(sample):
                    yield self._envelope([choice])
        if self.include_usage:
            final = self.generation.finals[self.generation.added[0].request_id]
            yield self._envelope([], self.usage(final))

    def usage(self, final: RequestOutput) -> dict:
        completion_tokens = sum(len(completion.token_ids) for completion in final.outputs)
        prompt_tokens = self.generation.num_prompt_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished choice, with its tool calls, and its finish reason."""
        parsed = self.plan.parse(text)
        if parsed is None:
            return {"role": "assistant", "content": text}, finish_reason
        calls = [tool_call_entry(call, tool_call_id()) for call in parsed.calls]
        if self.plan.mode in ("auto", "required") and finish_reason == "stop":
            finish_reason = "tool_calls"
        return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, finish_reason

    def _stream_choices(self, sample: SampleDelta) -> list[dict]:
        index = sample.index
        choices = []
        if index not in self._started:
            choices.append(self._delta(index, {"role": "assistant", "content": ""}))
            self._started.add(index)
        tools = self._tool_streams.setdefault(index, ToolCallStream(self.plan))
        piece = tools.feed(sample.text)
        if sample.finish_reason is not None:
            last = tools.finish()
            piece.content += last.content
            piece.tool_calls += last.tool_calls
        if piece.content or (self.num_top is not None and sample.token_ids):
            choices.append(self._delta(index, {"content": piece.content},
                                       self._logprobs(sample.logprobs, sample.token_ids)))
        if piece.tool_calls:
            choices.append(self._delta(index, {"tool_calls": piece.tool_calls}))
        if sample.finish_reason is not None:
            finish_reason = sample.finish_reason
            if tools.called and self.plan.mode in ("auto", "required") and finish_reason == "stop":
                finish_reason = "tool_calls"
            choices.append(self._delta(index, {}, finish_reason=finish_reason, stop_reason=sample.stop_reason))
        return choices

    def _logprobs(self, entries: list | None, token_ids: list[int]) -> dict | None:
        if self.num_top is None:
            return None
        return {"content": chat_logprobs(entries, token_ids, self.num_top)}

    @staticmethod
    def _delta(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return choice

    def _envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return chunk
