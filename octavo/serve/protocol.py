"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Fields, names and defaults follow the OpenAI API (and vLLM's extensions `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`). Validation is strict: a JSON string is not a number, `1.0` is not an
integer, infinities and NaN are rejected, and an unknown field is an error (as the OpenAI API answers
"Unrecognized request argument supplied"). Range checks of the sampling fields are left to
`SamplingParams`, whose error message names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20
"""Most alternatives per token in `logprobs` / `top_logprobs` (vLLM's default max_logprobs)."""

MAX_CHOICES = 128
"""Most samples per prompt (`n`), the OpenAI API's own limit."""

TokenIds = list[int]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """The fields both endpoints share; `SamplingParams` validates their ranges."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # Accepted and ignored, as they change nothing here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one request per prompt)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None

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
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

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
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
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
