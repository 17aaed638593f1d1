"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every rejection the server makes is an `APIError` (or an error FastAPI raises while reading the body,
translated here). Anything else reaching the handlers is a bug and answers 500, logged with its
traceback.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from octavo.errors import RequestError
from octavo.serve.request_model import SURROGATE
from octavo.serve.validation_messages import PREFERRED_ERROR_TYPES, openai_wording

logger = logging.getLogger(__name__)

_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+)")


class APIError(HTTPException):
    """A request the server rejects: HTTP `status` and the OpenAI error object's fields.

    An HTTPException, so that one raised while FastAPI reads the body (the body-size limit) reaches
    the handlers as itself rather than as FastAPI's generic "error parsing the body".
    """

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote request text that is not valid
    Unicode (a field name with a lone surrogate), which UTF-8 cannot encode but a JSON escape can."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def from_request_error(error: RequestError) -> APIError:
    """400 for an engine or SamplingParams rejection; `param` is the field the message names."""
    message = str(error)
    match = _SAMPLING_FIELD.match(message)
    param = match.group(1) if match else ("prompt" if "prompt" in message else None)
    return APIError(400, message, param=param)


def from_validation_error(error: RequestValidationError) -> APIError:
    """400 naming the offending field, with pydantic's reason.

    The first error is reported, unless a value check failed (a bound, a length, a check of ours: one
    union member's reason is more telling than another member's type mismatch). Bounds, lengths and
    missing fields are worded as OpenAI words them (`validation_messages`).
    """
    errors = error.errors()
    first = next((item for item in errors if item.get("type") in PREFERRED_ERROR_TYPES), errors[0])
    location = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        where = f" (at character {location[-1]})" if location else ""
        return APIError(400, f"the request body is not valid JSON: {reason}{where}")
    if first.get("type") == "string_unicode":  # a key pydantic could not even read (a lone surrogate)
        path = _invalid_text_path(error.body)
        field = ".".join(str(part) for part in path) if path else None
        return APIError(400, f"the request body holds text that is not valid Unicode (a lone surrogate) at "
                             f"'{field}'", param=field)
    field = ".".join(str(part) for part in _json_path(error.body, location)) or None
    if first.get("type") in ("unserved_field", "other_endpoint_field"):
        name = ".".join(str(part) for part in [*_json_path(error.body, location), first["ctx"]["field"]])
        return APIError(400, f"{first['msg']} (at '{name}')" if location else first["msg"], param=name)
    wording = openai_wording(first, field) if field is not None else None
    if wording is not None:
        return APIError(400, wording[0], param=field, code=wording[1])
    if field is None:
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    return APIError(400, f"invalid value for '{field}': {first.get('msg')}", param=field)


def _json_path(body: Any, location: list) -> list:
    """The parts of a pydantic error location that are keys and indexes of the JSON body.

    Inside a union a location also holds the member's tag (`str`, `list[int]`, `function-after[...]`),
    and under a dict key pydantic's marker `[key]`: walking the body tells those from real parts.
    """
    path, node = [], body
    for part in location:
        if part == "[key]":
            continue
        if isinstance(node, dict):
            path.append(part)
            node = node.get(part) if isinstance(part, str) else None
        elif isinstance(node, list) and isinstance(part, int):
            path.append(part)
            node = node[part] if 0 <= part < len(node) else None
        elif node is None and not path:
            path.append(part)
        # else: a tag below a list or a scalar
    return path


def _invalid_text_path(node: Any, path: tuple = ()) -> tuple | None:
    """The path of the first key or string in the body that holds a surrogate code point."""
    if isinstance(node, str):
        return path if SURROGATE.search(node) else None
    if isinstance(node, dict):
        for key, value in node.items():
            if SURROGATE.search(key):
                return (*path, key)
            found = _invalid_text_path(value, (*path, key))
            if found is not None:
                return found
    if isinstance(node, list):
        for index, value in enumerate(node):
            found = _invalid_text_path(value, (*path, index))
            if found is not None:
                return found
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI-style JSON error."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError) -> JSONResponse:
        return from_request_error(error).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), error_type, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(error).__name__}", "internal_server_error").response()
