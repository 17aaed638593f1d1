"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every rejection the server makes is an `APIError` (or an error FastAPI raises while reading the body,
translated here). Anything else reaching the handlers is a bug and answers 500, logged with its
traceback.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from octavo.errors import RequestError

logger = logging.getLogger(__name__)

_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+)")


class APIError(Exception):
    """A request the server rejects: HTTP `status` and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def from_request_error(error: RequestError) -> APIError:
    """400 for an engine or SamplingParams rejection; `param` is the field the message names."""
    message = str(error)
    match = _SAMPLING_FIELD.match(message)
    param = match.group(1) if match else ("prompt" if "prompt" in message else None)
    return APIError(400, message, param=param)


def from_validation_error(error: RequestValidationError) -> APIError:
    """400 naming the first offending field, with pydantic's reason."""
    first = error.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        where = f" (at character {location[-1]})" if location else ""
        return APIError(400, f"the request body is not valid JSON: {reason}{where}")
    field = ".".join(location) or None
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {field}", param=field)
    if first.get("type") == "missing":
        return APIError(400, f"missing required field '{field}'", param=field)
    if field is None:
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    return APIError(400, f"invalid value for '{field}': {first.get('msg')}", param=field)


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
