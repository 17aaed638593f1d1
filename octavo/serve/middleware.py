"""ASGI middleware: API-key check on /v1 routes and the count of HTTP requests by status.

Written as plain ASGI (not BaseHTTPMiddleware) so that streaming responses and the client's
`http.disconnect` pass through untouched. The key is checked before the body is read, so a request
without a valid key gets 401 whatever its body holds.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from octavo.serve.errors import APIError
from octavo.serve.metrics import ServerMetrics

KNOWN_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


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
        if path.startswith("/v1") and not self._authorized(scope):
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
