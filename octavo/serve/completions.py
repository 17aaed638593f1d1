"""POST /v1/completions: text or token-id prompts (one or many), streamed or not, as OpenAI answers.

Choice `i * n + j` is sample j of prompt i. `usage.prompt_tokens` counts each prompt once,
`usage.completion_tokens` every generated token of every sample (EOS included), as OpenAI does.

`max_tokens: 0` (OpenAI's schema allows it) generates nothing: each choice is the echoed prompt (with its
logprobs when `logprobs` asks) or empty text, `finish_reason` "length", no completion tokens: the way
evaluation harnesses score a prompt. The engine runs the prompt as a request for one token, whose token
is not shown, so the prompt must leave room for one token in the context, as for any request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from octavo.runtime.outputs import Logprob, RequestOutput
from octavo.serve.admission import check_prompt_chars, fit_max_tokens, sampling_params
from octavo.serve.context import Generation, ServerContext
from octavo.serve.errors import APIError
from octavo.serve.logprobs import completion_logprobs
from octavo.serve.protocol import CompletionRequest
from octavo.serve.sse import respond
from octavo.serve.stream import OutputDelta, SampleDelta
from octavo.serve.structured import compile_structure, requested_structure
from octavo.serve.tokenization import EncodedPrompt, encode_prompt

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    context: ServerContext = request.app.state.context
    lora = context.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    # echo with logprobs scores the prompt too (vLLM's prompt_logprobs).
    structure = requested_structure(body)
    generates = body.max_tokens != 0
    params = sampling_params(body, body.max_tokens if generates else 1, body.logprobs,
                             body.logprobs if body.echo else None, structure.spec if structure is not None else None)
    if not generates and params.min_tokens > 0:
        raise APIError(400, f"SamplingParams.min_tokens must be <= max_tokens=0, got {params.min_tokens}",
                       param="min_tokens")
    prompts = body.prompt_list()
    if not prompts:
        raise APIError(400, "the prompt is empty", param="prompt")
    for prompt in prompts:  # hopeless lengths are refused before anything is tokenized
        if isinstance(prompt, str):
            check_prompt_chars(prompt, context.character_bound, context.capacity, params.max_tokens, "prompt")
        else:
            fit_max_tokens(context.capacity, len(prompt), params.max_tokens, "prompt")

    def encode(tokenizer) -> list[EncodedPrompt]:
        return [encode_prompt(tokenizer, prompt, body.echo, body.add_special_tokens) for prompt in prompts]

    await compile_structure(context, structure)
    generation = await context.admit(len(prompts), params, encode, arrival, lora=lora)
    writer = CompletionWriter(context, generation, body, params.n)
    return await respond(request, generation, bool(body.stream), writer.chunks, writer.response)


class CompletionWriter:
    """Builds the response objects (streamed chunks or one body) of one completion request."""

    def __init__(self, context: ServerContext, generation: Generation, body: CompletionRequest, n: int):
        self.generation = generation
        self.generates = body.max_tokens != 0  # 0: the engine's one token is not shown
        self.id = f"cmpl-{generation.base_id}"
        self.created = int(time.time())
        self.model = body.model or context.settings.model_name
        self.n = n
        self.num_top = body.logprobs
        self.echo = body.echo
        self.include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        self._started: set[int] = set()
        self._text_offsets: dict[int, int] = {}

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                index = prompt_index * self.n + completion.index
                sample = self._shown(SampleDelta(completion.index, completion.text, completion.token_ids,
                                                 completion.logprobs, completion.finish_reason,
                                                 completion.stop_reason))
                sample.text = self._prompt_text(prompt_index) + sample.text
                choices.append(self._choice(index, sample, self._echoed(prompt_index, output.prompt_logprobs)))
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(finals)}

    async def chunks(self) -> AsyncIterator[dict]:
        while not self.generation.finished:
            prompt_index, delta = await self.generation.next_output()
            for sample in delta.samples:
                choice = self._stream_choice(prompt_index, sample, delta)
                if choice is not None:
                    yield self._envelope([choice])
        if self.include_usage:
            finals = [self.generation.finals[item.request_id] for item in self.generation.added]
            yield self._envelope([], self.usage(finals))

    def usage(self, finals: list[RequestOutput]) -> dict:
        completion_tokens = sum(len(completion.token_ids) for output in finals
                                for completion in output.outputs) if self.generates else 0
        prompt_tokens = self.generation.num_prompt_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _shown(self, sample: SampleDelta) -> SampleDelta:
        """`sample` as the response shows it: for max_tokens 0, none of the one token the engine generated."""
        if self.generates:
            return sample
        return SampleDelta(sample.index, "", [], [], "length" if sample.finish_reason is not None else None, None)

    def _stream_choice(self, prompt_index: int, sample: SampleDelta, delta: OutputDelta) -> dict | None:
        sample = self._shown(sample)
        index = prompt_index * self.n + sample.index
        first = index not in self._started
        text = (self._prompt_text(prompt_index) if first else "") + sample.text
        wants_logprobs = self.num_top is not None and sample.token_ids
        if not text and not wants_logprobs and sample.finish_reason is None:
            return None
        self._started.add(index)
        echoed = self._echoed(prompt_index, delta.prompt_logprobs) if first else None
        return self._choice(index, SampleDelta(sample.index, text, sample.token_ids, sample.logprobs,
                                               sample.finish_reason, sample.stop_reason), echoed)

    def _choice(self, index: int, sample: SampleDelta, echoed: tuple[list, list[int], str] | None = None) -> dict:
        """The choice for `sample` (its text already holds any echoed prompt); `echoed` adds the prompt's logprobs."""
        logprobs = None
        if self.num_top is not None:
            entries, token_ids = sample.logprobs, sample.token_ids
            unscored_text = ""
            if echoed is not None:
                prompt_entries, prompt_token_ids, unscored_text = echoed
                entries, token_ids = prompt_entries + entries, prompt_token_ids + token_ids
            logprobs, self._text_offsets[index] = completion_logprobs(
                entries, token_ids, self.num_top, self._text_offsets.get(index, 0), unscored_text)
        return {"index": index, "text": sample.text, "logprobs": logprobs, "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason}

    def _envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return chunk

    def _echoed(self, prompt_index: int, prompt_logprobs: list[dict[int, Logprob] | None] | None
                ) -> tuple[list, list[int], str] | None:
        """(prompt logprob entries, prompt token ids, first token's text) when echo asks for logprobs."""
        if not (self.echo and self.num_top is not None):
            return None
        added = self.generation.added[prompt_index]
        return list(prompt_logprobs or []), added.prompt_token_ids, added.first_token_text

    def _prompt_text(self, prompt_index: int) -> str:
        return (self.generation.added[prompt_index].prompt_text or "") if self.echo else ""
