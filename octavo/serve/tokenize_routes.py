"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version.

/tokenize takes a text `prompt` (special tokens added, as a completion prompt is encoded) or chat
`messages` with optional `tools` (rendered by the chat template with the assistant turn opened, as
a chat completion is), and answers `{"count", "max_model_len", "tokens", "token_strs"}`;
/detokenize answers `{"prompt"}` for a list of token ids. The request and response shapes are
vLLM's. The tokenizer work runs on the tokenizer threads, like a completion's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from octavo import __version__
from octavo.serve.context import ServerContext
from octavo.serve.errors import APIError
from octavo.serve.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    template_messages,
    tool_definitions,
)
from octavo.serve.tokenization import encode, render_chat

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: dict[str, Any], request: Request) -> JSONResponse:
    # Which form is meant is told by `messages`, so that errors name the fields of that form only.
    if "messages" in body and "prompt" in body:
        raise APIError(400, "give either `prompt` or `messages`, not both", param="prompt")
    parsed = _validate(TokenizeChatRequest if "messages" in body else TokenizePromptRequest, body)
    context: ServerContext = request.app.state.context
    context.check_model(parsed.model)

    if isinstance(parsed, TokenizeChatRequest):
        messages = template_messages(parsed.messages)
        tools = tool_definitions(parsed.tools)

        def token_ids(tokenizer) -> list[int]:
            return render_chat(tokenizer, messages, tools=tools, add_generation_prompt=parsed.add_generation_prompt,
                               continue_final_message=parsed.continue_final_message,
                               add_special_tokens=parsed.add_special_tokens,
                               template_kwargs=parsed.chat_template_kwargs).token_ids
    else:
        def token_ids(tokenizer) -> list[int]:
            return encode(tokenizer, parsed.prompt, add_special_tokens=parsed.add_special_tokens)

    def run(tokenizer) -> tuple[list[int], list[str] | None]:
        ids = token_ids(tokenizer)
        return ids, (tokenizer.convert_ids_to_tokens(ids) if parsed.return_token_strs else None)

    tokens, token_strs = await context.encoder.run(run)
    return JSONResponse({"count": len(tokens), "max_model_len": context.engine.engine.max_model_len,
                         "tokens": tokens, "token_strs": token_strs})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    context: ServerContext = request.app.state.context
    context.check_model(body.model)

    def decode(tokenizer) -> str:
        vocabulary = len(tokenizer)
        for index, token_id in enumerate(body.tokens):
            if token_id >= vocabulary:
                raise APIError(400, f"token id {token_id} is outside the vocabulary (0..{vocabulary - 1})",
                               param=f"tokens.{index}")
        return tokenizer.decode(body.tokens)

    return JSONResponse({"prompt": await context.encoder.run(decode)})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


def _validate(model: type, body: dict[str, Any]) -> Any:
    """`body` as `model`; a failure is reported like FastAPI's own body validation (400 naming the field)."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise RequestValidationError(error.errors(), body=body) from None
