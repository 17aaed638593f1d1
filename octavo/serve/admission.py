"""Turning a request body into engine requests: sampling parameters, tokenization, length checks.

`sampling_params` runs on the event loop (cheap, and rejects bad fields before anything is queued).
`add_prompts` and `render_chat` run on the engine thread (they use the tokenizer, which the engine
also uses, and `engine.add_request`, which only that thread may call).
"""

from __future__ import annotations

from dataclasses import dataclass

from octavo.errors import RequestError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from octavo.serve.errors import APIError, from_request_error
from octavo.serve.protocol import SamplingFields

Prompt = str | list[int]


@dataclass
class AddedPrompt:
    """One engine request an HTTP request made: its id, its prompt as text (for echo) and as tokens."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    first_token_text: str = ""  # for echo with logprobs: no logprob scores the first prompt token


def sampling_params(fields: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
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
    }
    options = {name: value for name, value in options.items() if value is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, **options)
    except RequestError as error:
        raise from_request_error(error) from None


def context_capacity(engine: LLMEngine) -> tuple[int, str]:
    """Most tokens (prompt + output) one sequence may hold, and what sets that limit."""
    kv_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    if kv_tokens < engine.max_model_len:
        return kv_tokens, "KV cache"
    return engine.max_model_len, "maximum context length"


def fit_max_tokens(engine: LLMEngine, num_prompt_tokens: int, max_tokens: int | None, prompt_field: str) -> int:
    """The request's max_tokens (None = as many as fit); 400 with both numbers when they do not fit."""
    capacity, limit = context_capacity(engine)
    if max_tokens is None:
        if num_prompt_tokens >= capacity:
            raise APIError(400, f"This model's {limit} is {capacity} tokens. However, the prompt has "
                                f"{num_prompt_tokens} tokens and at least 1 must be generated. "
                                f"Please reduce the length of the prompt.", param=prompt_field)
        return capacity - num_prompt_tokens
    if num_prompt_tokens + max_tokens > capacity:
        raise APIError(400, f"This model's {limit} is {capacity} tokens. However, you requested "
                            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
                            f"max_tokens.", param="max_tokens")
    return max_tokens


def add_prompts(engine: LLMEngine, request_ids: list[str], prompts: list[Prompt], params: SamplingParams,
                want_text: bool, prompt_field: str = "prompt") -> list[AddedPrompt]:
    """Tokenize, check and add every prompt, or none: on an error the ones added are aborted."""
    encoded = [_encode(engine, prompt) for prompt in prompts]
    limits = [fit_max_tokens(engine, len(token_ids), params.max_tokens, prompt_field) for token_ids in encoded]
    added: list[AddedPrompt] = []
    try:
        for request_id, prompt, token_ids, max_tokens in zip(request_ids, prompts, encoded, limits, strict=True):
            request_params = params if max_tokens == params.max_tokens else params.clone(max_tokens=max_tokens)
            engine.add_request(token_ids, request_params, request_id=request_id)
            first_text = engine.tokenizer.decode(token_ids[:1]) if want_text else ""
            added.append(AddedPrompt(request_id, _prompt_text(engine, prompt, want_text), token_ids, first_text))
    except BaseException:
        for item in added:
            engine.abort_request(item.request_id)
        raise
    return added


def render_chat(engine: LLMEngine, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the chat template with the assistant turn opened (as LLM.chat)."""
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # a template may raise anything on messages it does not accept
        raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
    return tokenizer.encode(rendered, add_special_tokens=False)


def _encode(engine: LLMEngine, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return engine.tokenizer.encode(prompt)
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    return list(prompt)


def _prompt_text(engine: LLMEngine, prompt: Prompt, want_text: bool) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prompt) if want_text else None
