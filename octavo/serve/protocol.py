"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Fields, names and defaults follow the OpenAI API (and vLLM's extensions `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `add_special_tokens`). Every body is a `request_model.StrictModel`: strict
types, valid Unicode, unknown fields ignored and logged, vLLM's unserved fields refused by name. Numbers
are held to the ranges the OpenAI API reference documents (temperature 0..2, top_p 0..1, penalties
-2..2, logit_bias values -100..100, n 1..128, top_logprobs 0..20, seed a signed 64-bit integer, stop
1 to 4 strings, a prompt list or token list not empty, metadata 16 pairs of 64 / 512 characters,
service_tier one of its names) or, for vLLM's fields and where vLLM is stricter, to vLLM's (top_p > 0,
top_k -1 or more, min_p 0..1, repetition_penalty in (0, 2]). One bound is vLLM's where it serves more:
completions' `logprobs` goes to 20 (vLLM's default max_logprobs; OpenAI's is 5). `stream_options` is
only allowed with `stream: true`, as OpenAI and vLLM answer. Cross-field rules (min_tokens <=
max_tokens, token ids inside the vocabulary, greedy with n 1) are left to `SamplingParams` and the
engine, whose messages name the field.

Messages follow the OpenAI API's schema by role: system, developer, user and tool messages need
`content` (a string or a non-empty list of text parts), a tool message also `tool_call_id`, an
assistant message `content` or `tool_calls`. A parameter of the other endpoint (`messages` sent to
/v1/completions, `prompt` or `echo` to /v1/chat/completions) is a 400 naming it, not ignored.

Explicit JSON nulls: a field the OpenAI API documents as nullable takes null as its default (`n`
null samples once, `logprobs` and `echo` null are off); vLLM's own fields are not nullable, as in
vLLM. Chat requests take OpenAI's tool fields (`tools`, `tool_choice`, `parallel_tool_calls`) and
the messages of a tool conversation (assistant `tool_calls`, tool `tool_call_id`); which tool
choices the server serves is decided by `octavo.serve.tools`. Chat requests also take vLLM's
template fields `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from octavo.serve.request_model import (
    INT64_MAX,
    INT64_MIN,
    JsonObject,
    NullMeansDefault,
    StrictModel,
    Text,
    TokenIds,
    valid_unicode_json,
)
from octavo.serve.structured import StructuredOutputFields

MAX_LOGPROBS = 20
"""Most alternatives per token in `logprobs` / `top_logprobs` (vLLM's default max_logprobs)."""

MAX_CHOICES = 128
"""Most samples per prompt (`n`), the OpenAI API's own limit."""

LOGIT_BIAS_LIMIT = 100.0
"""logit_bias values lie in [-100, 100] (OpenAI)."""

MAX_STOP_SEQUENCES = 4
"""`stop` holds up to 4 sequences (OpenAI)."""

SERVICE_TIERS = Literal["auto", "default", "flex", "scale", "priority", "fast"]
"""The values of OpenAI's `service_tier` (accepted and ignored: this server has one tier)."""

TokenIdText = Annotated[Text, Field(pattern=r"^[0-9]+$")]
"""A token id written as a JSON object key (logit_bias): decimal digits only."""


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StructuredOutputFields, NullMeansDefault):
    """The fields both endpoints share; `SamplingParams` validates their ranges. Structured output's fields
    (`response_format`, `guided_*`, `structured_outputs`) are in `octavo.serve.structured`."""

    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"n"})

    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    stop: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_STOP_SEQUENCES)] | None = None
    stop_token_ids: TokenIds | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[TokenIdText, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Text | None = None
    # Accepted and ignored, as they change nothing here (metadata: OpenAI's 16 pairs of 64 / 512 characters).
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: SERVICE_TIERS | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and info.data.get("stream") is not True and "stream" in info.data:
            raise ValueError("The 'stream_options' parameter is only allowed when 'stream' is enabled.")
        return options


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one request per prompt).

    `max_tokens` null is up to the model's length (as vLLM reads it), absent 16 (OpenAI's default).
    """

    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"n", "echo"})

    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | Annotated[TokenIds, Field(min_length=1)]
             | Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1)])
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 16
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens around a text prompt
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


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
"""OpenAI's rule for function names: letters, digits, underscores and dashes, at most 64."""


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


def tool_definitions(tools: list[Tool] | None) -> list[dict] | None:
    """`tools` as the chat template reads them (the fields the client sent), None for none."""
    return [tool.model_dump(exclude_unset=True) for tool in tools] if tools else None


class NamedFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


def json_arguments(arguments: str) -> str:
    """`arguments` unless it is neither empty nor JSON text (whose strings must be valid Unicode too)."""
    if arguments.strip():
        try:
            valid_unicode_json(json.loads(arguments))
        except json.JSONDecodeError as error:
            raise ValueError(f"the arguments are not JSON: {error}") from None
        except RecursionError:  # other ValueErrors (a lone surrogate, a 5000-digit number) say what is wrong
            raise ValueError("the arguments nest too deeply") from None
    return arguments


class FunctionCall(StrictModel):
    name: Text
    arguments: Annotated[Text, AfterValidator(json_arguments)]


class ToolCall(StrictModel):
    id: Text
    type: Literal["function"]
    function: FunctionCall


ROLES_NEEDING_CONTENT = frozenset({"system", "developer", "user", "tool"})


def _missing_for_role(field: str, role: str, why: str = "") -> PydanticCustomError:
    article = "an" if role[0] in "aeiou" else "a"
    return PydanticCustomError("missing_for_role", "{article} {role} message needs '{field}'{why}",
                               {"article": article, "role": role, "field": field, "why": why})


class ChatMessage(StrictModel):
    """One message of a conversation; what each role requires is in the module docstring.

    The fields are declared in the order their checks read each other (a field validator sees only the
    fields before it), and `content` and `tool_call_id` are checked also when absent.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Annotated[Text | None, Field(validate_default=True)] = None
    content: Annotated[Text | Annotated[list[TextContentPart], Field(min_length=1)] | None,
                       Field(validate_default=True)] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported: the models Octavo "
                                     "serves read text only")
        return content

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_by_role(cls, tool_call_id: str | None, info: ValidationInfo) -> str | None:
        if tool_call_id is None and info.data.get("role") == "tool":
            raise _missing_for_role("tool_call_id", "tool")
        return tool_call_id

    @field_validator("content")
    @classmethod
    def _content_by_role(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role in ROLES_NEEDING_CONTENT:
            raise _missing_for_role("content", role)
        if content is None and role == "assistant" and not info.data.get("tool_calls") \
                and "tool_calls" in info.data:
            raise _missing_for_role("content", role, " or 'tool_calls'")
        return content

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to a {self.role} message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not to a {self.role} message")
        return self

    def text(self) -> str:
        """The message's text (content parts are concatenated; null content, as beside tool calls, is empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. The messages go through the artifact's chat template."""

    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"n", "logprobs"})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # absent: "auto" with tools, else "none" (OpenAI); null: "none" (vLLM)
    parallel_tool_calls: bool | None = None  # accepted; no tool calls are produced to run in parallel
    # The deprecated predecessors of tools / tool_choice, accepted only as null.
    functions: Any = None
    function_call: Any = None
    # vLLM's chat-template extensions: the assistant turn opened or the last message continued, and
    # extra variables for the template (e.g. Qwen3's enable_thinking).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JsonObject | None = None
    add_special_tokens: bool = False  # vLLM's: the template writes the special tokens itself

    @field_validator("functions", "function_call")
    @classmethod
    def _only_null(cls, value: Any, info) -> Any:
        if value is not None:
            newer = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"`{info.field_name}` is deprecated in the OpenAI API and not supported here; "
                             f"use `{newer}`")
        return value

    def effective_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) wins over `max_tokens`; None = up to the model length."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """The messages as the chat template expects them."""
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages in the shape Hugging Face chat templates read.

    `developer` is the newer name of `system`. Tool-call arguments arrive as JSON text and are given
    to the template parsed, as transformers documents them (and vLLM passes them); an empty text is
    no arguments.
    """
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": parsed_arguments(call.function.arguments)}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


def parsed_arguments(arguments: str) -> Any:
    """Tool-call arguments (JSON text, checked by `json_arguments`) as a value; "" is no arguments ({})."""
    return json.loads(arguments) if arguments.strip() else {}


class TokenizePromptRequest(StrictModel):
    """POST /tokenize with a text prompt (vLLM's TokenizeCompletionRequest)."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictModel):
    """POST /tokenize with messages (and tools), rendered by the chat template (vLLM's TokenizeChatRequest)."""

    model: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JsonObject | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(StrictModel):
    """POST /detokenize."""

    model: Text | None = None
    tokens: TokenIds


def _endpoint_only_fields(model: type[StrictModel], other: type[StrictModel], path: str) -> dict[str, str]:
    return dict.fromkeys(sorted(set(model.model_fields) - set(other.model_fields)), path)


CompletionRequest.OTHER_ENDPOINT_FIELDS = _endpoint_only_fields(ChatCompletionRequest, CompletionRequest,
                                                                "/v1/chat/completions")
ChatCompletionRequest.OTHER_ENDPOINT_FIELDS = _endpoint_only_fields(CompletionRequest, ChatCompletionRequest,
                                                                    "/v1/completions")
