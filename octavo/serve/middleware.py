"""ASGI middleware: API-key check on /v1 routes, /tokenize and /detokenize, and the count of HTTP requests by status.

Written as plain ASGI (not BaseHTTPMiddleware) so that streaming responses and the client's
`http.disconnect` pass through untouched. The key is checked before the body is read, so a request
without a valid key gets 401 whatever its body holds.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from octavo.serve.errors import APIError
from octavo.serve.metrics import ServerMetrics

KNOWN_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                             "/tokenize", "/detokenize", "/version"})
# The tokenizer endpoints spend the server's tokenizer threads, so they need the key too (vLLM checks /v1 only).
PROTECTED_ROOT_ENDPOINTS = frozenset({"/tokenize", "/detokenize"})


class ServerMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, api_key: str | None):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        if (path.startswith("/v1") or path in PROTECTED_ROOT_ENDPOINTS) and not self._authorized(scope):
            self.metrics.http_requests.labels(endpoint, "401").inc()
            error = APIError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer KEY'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        status = "500"

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.http_requests.labels(endpoint, status).inc()

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(),
                                                                               self.api_key.encode("utf-8"))
        return False


class RequestBodyLimit:
    """413 for a request body over `max_bytes`, refused before it is read.

    A declared Content-Length over the limit is refused at once; a body sent without one (chunked)
    is counted as it arrives and refused as soon as the count passes the limit. uvicorn reads at most
    its buffer's worth ahead, so the server never holds more than about the limit; the connection is
    closed after the 413, so the rest of the body is not read either.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            error = self._too_large(f"the request body has {declared} bytes, more than")
            await error.response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large("the request body is larger than")
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self, what: str) -> APIError:
        # Connection: close, or uvicorn would go on reading (and discarding) the rest of the body.
        return APIError(413, f"{what} the server's limit of {self.max_bytes} bytes (--max-request-bytes)",
                        code="request_too_large", headers={"Connection": "close"})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length" and value.strip().isdigit():
            return int(value)
    return None
