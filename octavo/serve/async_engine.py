"""AsyncEngine: one thread owns the LLMEngine; the asyncio event loop talks to it through a queue.

The LLMEngine is not thread-safe, so every touch of it (adding, aborting, stepping, reading its
queues for metrics) happens on the engine thread. The event loop submits functions with `call`
(awaitable, returns the function's result or raises its exception) or `abort` (fire and forget).
The engine thread runs queued functions between steps, steps while requests are unfinished, and
sleeps on the queue when there is nothing to do. Each step's outputs go back to the loop in one
`call_soon_threadsafe`, so the loop never waits on the engine and answers `/health` during a step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from octavo.errors import WorkerFailedError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.metrics import EngineMetrics, collect_engine_metrics
from octavo.runtime.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (it failed, or the server is shutting down)."""


class RequestStream:
    """The outputs of the engine requests one HTTP request made (one per prompt), in step order.

    Lives on the event loop. `next_output()` returns each output the engine produced for one of the
    request ids, and raises if the engine failed while the requests ran.
    """

    def __init__(self, request_ids: Iterable[str]):
        self.request_ids = list(request_ids)
        self.unfinished = set(self.request_ids)
        self._items: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.put_nowait(item)

    async def next_output(self) -> RequestOutput:
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item


@dataclass
class _Command:
    function: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future | None


_STOP = _Command(lambda engine: None, None)


class AsyncEngine:
    """Runs `engine` on its own thread; see the module docstring. Start it from the event loop."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.metrics: EngineMetrics = collect_engine_metrics(engine)
        self.failure: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side ----

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def call(self, function: Callable[[LLMEngine], T]) -> T:
        """Run `function(engine)` on the engine thread between two steps and return its result."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Command(function, future))
        return await asyncio.wrap_future(future)

    def open_stream(self, request_ids: Iterable[str]) -> RequestStream:
        """Register a stream for `request_ids` before they are added, so no output is missed."""
        stream = RequestStream(request_ids)
        for request_id in stream.request_ids:
            self._streams[request_id] = stream
        return stream

    def close_stream(self, stream: RequestStream) -> None:
        """Unregister `stream`; requests of it that have not finished are aborted (blocks freed)."""
        for request_id in stream.request_ids:
            self._streams.pop(request_id, None)
        if stream.unfinished:
            self.abort(sorted(stream.unfinished))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their final outputs are delivered."""
        request_ids = list(request_ids)
        self._commands.put(_Command(lambda engine: self._abort(engine, request_ids), None))

    def abort_all(self) -> None:
        """Abort every request the engine holds (the end of the shutdown grace period)."""
        self._commands.put(_Command(lambda engine: self._abort(engine, list(engine.requests)), None))

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, then end the engine thread."""
        if not self.is_alive:
            return
        self.abort_all()
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.put(error)

    # ---- engine-thread side ----

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                for command in self._take_commands(block=idle):
                    if command is _STOP:
                        return
                    self._execute(command)
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # the thread must not die silently
            logger.exception("the engine thread failed")
            self.failure = error
            self._to_loop(self._fail_streams, EngineDeadError(f"the engine failed: {error}"))

    def _take_commands(self, block: bool) -> list[_Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _execute(self, command: _Command) -> None:
        future = command.future
        if future is not None and not future.set_running_or_notify_cancel():
            return  # the caller went away before the command ran
        try:
            result = command.function(self.engine)
        except BaseException as error:
            self.metrics = collect_engine_metrics(self.engine)
            if future is None:
                logger.exception("engine command failed")
            else:
                future.set_exception(error)
            return
        # Publish the new state before the caller sees the result, so admission control never
        # sees a request in neither the engine's queues nor the pending count.
        self.metrics = collect_engine_metrics(self.engine)
        if future is not None:
            future.set_result(result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerFailedError:
            raise  # a parallel engine lost a rank: end the thread, so requests get 503 from now on
        except Exception as error:
            # A bug: fail the requests in flight (their blocks are freed) and keep serving.
            logger.exception("engine step failed; aborting %d request(s)", len(self.engine.requests))
            self._abort(self.engine, list(self.engine.requests))
            self._to_loop(self._fail_streams, RuntimeError(f"engine step failed: {type(error).__name__}"))
            return
        self.metrics = collect_engine_metrics(self.engine)
        if outputs:
            self._to_loop(self._dispatch, outputs)

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        outputs = [output for output in map(engine.abort_request, request_ids) if output is not None]
        self.metrics = collect_engine_metrics(engine)
        if outputs:
            self._to_loop(self._dispatch, outputs)

    def _to_loop(self, function: Callable, argument: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(function, argument)
