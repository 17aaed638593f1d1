"""Turning a request body into engine requests: sampling parameters, length checks, adding.

`sampling_params`, `check_prompt_chars` and `fit_max_tokens` run on the event loop (cheap; they reject
bad requests before anything is tokenized or queued). Tokenizing runs on the tokenizer threads
(`tokenization`). Only `add_prompts`, which calls `engine.add_request` with token ids, runs on the
engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from octavo.errors import RequestError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured.spec import StructuredOutputs
from octavo.serve.errors import APIError, from_request_error
from octavo.serve.prompt_limits import CharacterBound
from octavo.serve.protocol import SamplingFields
from octavo.serve.tokenization import EncodedPrompt


@dataclass
class AddedPrompt:
    """One engine request an HTTP request made: its id, its prompt as text (for echo) and as tokens."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    first_token_text: str = ""  # for echo with logprobs: no logprob scores the first prompt token


@dataclass(frozen=True)
class Capacity:
    """Most tokens (prompt + output) one sequence may hold, and what sets that limit."""

    tokens: int
    limit: str

    @classmethod
    def of(cls, engine: LLMEngine) -> Capacity:
        kv_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
        if kv_tokens < engine.max_model_len:
            return cls(kv_tokens, "KV cache")
        return cls(engine.max_model_len, "maximum context length")


def sampling_params(fields: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, structured: StructuredOutputs | None = None) -> SamplingParams:
    """SamplingParams from the request (OpenAI defaults where a field is absent); bad values -> 400."""
    options = {
        "n": fields.n,
        "temperature": fields.temperature,
        "top_p": fields.top_p,
        "top_k": fields.top_k,
        "min_p": fields.min_p,
        "presence_penalty": fields.presence_penalty,
        "frequency_penalty": fields.frequency_penalty,
        "repetition_penalty": fields.repetition_penalty,
        "stop": fields.stop,
        "stop_token_ids": fields.stop_token_ids,
        "seed": fields.seed,
        "logit_bias": fields.logit_bias,
        "ignore_eos": fields.ignore_eos,
        "min_tokens": fields.min_tokens,
        "skip_special_tokens": fields.skip_special_tokens,
        "include_stop_str_in_output": fields.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "structured": structured,
    }
    options = {name: value for name, value in options.items() if value is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, **options)
    except RequestError as error:
        raise from_request_error(error) from None


def check_prompt_chars(text: str, bound: CharacterBound | None, capacity: Capacity, max_tokens: int | None,
                       field: str) -> None:
    """400 when `text` has so many characters that no tokenization of it fits (see prompt_limits)."""
    if bound is None:
        return
    at_least = bound.min_tokens(text)
    why = (f"the prompt has {len(text)} characters, so at least {at_least} tokens (no token of this tokenizer "
           f"covers more than {bound.max_chars_per_token} characters)")
    if max_tokens is None:
        if at_least >= capacity.tokens:
            raise APIError(400, f"This model's {capacity.limit} is {capacity.tokens} tokens. However, {why}, and "
                                f"at least 1 must be generated. Please reduce the length of the prompt.",
                           param=field)
    elif at_least + max_tokens > capacity.tokens:
        raise APIError(400, f"This model's {capacity.limit} is {capacity.tokens} tokens. However, you requested at "
                            f"least {at_least + max_tokens} tokens ({why}; {max_tokens} for the completion). "
                            f"Please reduce the length of the prompt or max_tokens.", param="max_tokens")


def fit_max_tokens(capacity: Capacity, num_prompt_tokens: int, max_tokens: int | None, prompt_field: str) -> int:
    """The request's max_tokens (None = as many as fit); 400 with both numbers when they do not fit."""
    if max_tokens is None:
        if num_prompt_tokens >= capacity.tokens:
            raise APIError(400, f"This model's {capacity.limit} is {capacity.tokens} tokens. However, the prompt "
                                f"has {num_prompt_tokens} tokens and at least 1 must be generated. "
                                f"Please reduce the length of the prompt.", param=prompt_field)
        return capacity.tokens - num_prompt_tokens
    if num_prompt_tokens + max_tokens > capacity.tokens:
        raise APIError(400, f"This model's {capacity.limit} is {capacity.tokens} tokens. However, you requested "
                            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
                            f"max_tokens.", param="max_tokens")
    return max_tokens


def add_prompts(engine: LLMEngine, request_ids: list[str], encoded: list[EncodedPrompt], params: SamplingParams,
                limits: list[int], lora: str | None = None) -> list[AddedPrompt]:
    """Add every prompt (on the engine thread), or none: on an error the ones added are aborted."""
    added: list[AddedPrompt] = []
    try:
        for request_id, prompt, max_tokens in zip(request_ids, encoded, limits, strict=True):
            request_params = params if max_tokens == params.max_tokens else params.clone(max_tokens=max_tokens)
            engine.add_request(prompt.token_ids, request_params, request_id=request_id, lora=lora)
            added.append(AddedPrompt(request_id, prompt.prompt_text, prompt.token_ids, prompt.first_token_text))
    except BaseException:
        for item in added:
            engine.abort_request(item.request_id)
        raise
    return added
