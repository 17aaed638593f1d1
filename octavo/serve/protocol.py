"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Fields, names and defaults follow the OpenAI API (and vLLM's extensions `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`). Validation is strict: a JSON string is not a number, `1.0` is not an
integer, infinities and NaN are rejected, and an unknown field is an error (as the OpenAI API answers
"Unrecognized request argument supplied"). Every text must be valid Unicode: JSON can spell a lone
surrogate ("\\ud800"), which no tokenizer or UTF-8 encoder accepts. Numbers are held to the ranges
the OpenAI API reference documents (temperature 0..2, top_p 0..1, penalties -2..2, logit_bias values
-100..100, n 1..128, top_logprobs 0..20, seed a signed 64-bit integer) or, for vLLM's fields and where
vLLM is stricter, to vLLM's (top_p > 0, top_k -1 or more, min_p 0..1, repetition_penalty in (0, 2],
logprobs 0..20 as vLLM's default max_logprobs). Cross-field rules (min_tokens <= max_tokens, token ids
inside the vocabulary, greedy with n 1) are left to `SamplingParams` and the engine, whose messages
name the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20
"""Most alternatives per token in `logprobs` / `top_logprobs` (vLLM's default max_logprobs)."""

MAX_CHOICES = 128
"""Most samples per prompt (`n`), the OpenAI API's own limit."""

LOGIT_BIAS_LIMIT = 100.0
"""logit_bias values lie in [-100, 100] (OpenAI)."""

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """`text` unless it holds a surrogate code point, which is not a character (JSON's lone "\\udXXX")."""
    found = SURROGATE.search(text)
    if found is not None:
        raise ValueError(f"not valid Unicode: lone surrogate U+{ord(found.group()):04X} at character "
                         f"{found.start()}")
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenIds = list[TokenId]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """The fields both endpoints share; `SamplingParams` validates their ranges."""

    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: TokenIds | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[Text, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Text | None = None
    # Accepted and ignored, as they change nothing here (metadata: OpenAI's 16 pairs of 64 / 512 characters).
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: Text | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one request per prompt)."""

    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Text | None = None

    def prompt_list(self) -> list[str | TokenIds]:
        """The prompts as a list: one text or one token-id list per engine request."""
        prompt: Any = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(item, int) for item in prompt):
            return [prompt]
        return list(prompt)


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: Text


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        """The message's text (content parts are concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(StrictModel):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. The messages go through the artifact's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None

    def effective_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) wins over `max_tokens`; None = up to the model length."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """The messages as the chat template expects them (`developer` is the newer name of `system`)."""
        rendered = []
        for message in self.messages:
            entry = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
            if message.name is not None:
                entry["name"] = message.name
            rendered.append(entry)
        return rendered
