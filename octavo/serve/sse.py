"""Server-sent events and client-disconnect handling shared by the generation endpoints.

Streaming: `event_stream` wraps the endpoint's chunk generator into a `text/event-stream` response
whose body is `data: {json}` events ending with `data: [DONE]`; a failure after the status line (the
engine died, or the client read too slowly and its request was aborted) is an OpenAI-style error
event before `[DONE]`. When the client disconnects,
Starlette cancels the body iterator; the generation is closed (its requests aborted) by the
iterator's `finally` and, should the iterator never have started, by the response's background task.

Non-streaming: `until_disconnect` races the work against the client's `http.disconnect`, so a client
that gives up waiting also aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from octavo.serve.async_engine import EngineDeadError
from octavo.serve.context import Generation
from octavo.serve.errors import error_body
from octavo.serve.stream import StreamBacklogError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DONE_EVENT = "data: [DONE]\n\n"


class ClientDisconnectedError(Exception):
    """The client closed the connection before the response was ready."""


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_stream(generation: Generation, chunks: Callable[[], AsyncIterator[dict]]) -> StreamingResponse:
    """The SSE response for `chunks()`; an engine failure mid-stream becomes an error event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks():
                yield sse_event(chunk)
        except StreamBacklogError as error:  # the status line is sent: an error can only be an event now
            logger.warning("stream %s aborted: %s", generation.base_id, error)
            yield sse_event(error_body(str(error), "invalid_request_error", code="reader_too_slow"))
        except Exception as error:
            if not isinstance(error, EngineDeadError):
                logger.exception("stream %s failed", generation.base_id)
            yield sse_event(error_body(str(error), "internal_server_error"))
        finally:
            generation.close()
        yield DONE_EVENT

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(generation.close))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnectedError."""
    work_task = asyncio.ensure_future(work)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task in done:
        return work_task.result()
    raise ClientDisconnectedError()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def respond(request: Request, generation: Generation, stream: bool,
                  chunks: Callable[[], AsyncIterator[dict]], body: Callable[[list], dict]) -> Response:
    """The endpoint's answer: SSE of `chunks()` when streaming; otherwise `body(final outputs)` as JSON,
    or 499 when the client disconnects first (its requests are aborted when the generation closes)."""
    if stream:
        return event_stream(generation, chunks)
    try:
        finals = await until_disconnect(request, generation.final_outputs())
    except ClientDisconnectedError:
        return Response(status_code=499)
    finally:
        generation.close()
    return JSONResponse(body(finals))
