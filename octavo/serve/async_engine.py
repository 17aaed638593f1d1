"""AsyncEngine: one thread owns the LLMEngine; the asyncio event loop talks to it through a queue.

The LLMEngine is not thread-safe, so every touch of it (adding, aborting, stepping, reading its
queues for metrics) happens on the engine thread. The event loop submits functions with `call`
(awaitable, returns the function's result or raises its exception) or `abort` (fire and forget).
The engine thread runs queued functions between steps, steps while requests are unfinished, and
sleeps on the queue when there is nothing to do. Each step's outputs become deltas on the engine
thread (see `stream`) and go back to the loop in one `call_soon_threadsafe`, so the loop never
waits on the engine and answers `/health` during a step.

When the engine thread ends (stopped, or failed), every command still queued fails with
`EngineDeadError`, and so does every later `call`: no caller waits forever.
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
from octavo.serve.stream import DEFAULT_MAX_BACKLOG, DeltaTracker, OutputDelta, RequestStream

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (it failed, or the server is shutting down)."""


@dataclass
class _Command:
    function: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future | None


_STOP = _Command(lambda engine: None, None)


class AsyncEngine:
    """Runs `engine` on its own thread; see the module docstring. Start it from the event loop.

    `metrics` and `waiting_tokens` (tokens the waiting sequences hold, prompt and output so far) are
    published by the engine thread after every step and command, for admission control and /metrics.
    """

    def __init__(self, engine: LLMEngine, max_stream_backlog: int = DEFAULT_MAX_BACKLOG):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.max_stream_backlog = max_stream_backlog
        self.metrics: EngineMetrics = collect_engine_metrics(engine)
        self.waiting_tokens = 0
        self.failure: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "closed" against queuing a command
        self._closed_reason: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._deltas = DeltaTracker()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side ----

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._closed_reason is None

    async def call(self, function: Callable[[LLMEngine], T]) -> T:
        """Run `function(engine)` on the engine thread between two steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Command(function, future))
        return await asyncio.wrap_future(future)

    def open_stream(self, request_ids: Iterable[str],
                    on_output: Callable[[OutputDelta], None] | None = None) -> RequestStream:
        """Register a stream for `request_ids` before they are added, so no output is missed."""
        stream = RequestStream(request_ids, self.max_stream_backlog, on_output, self._abort_stream)
        for request_id in stream.request_ids:
            self._streams[request_id] = stream
        return stream

    def close_stream(self, stream: RequestStream) -> None:
        """The reader is gone: requests of the stream still running are aborted (blocks freed).

        The stream stays registered until their final outputs arrive, so its `on_output` sees how
        each one really ended (finished on its own, or aborted).
        """
        if stream.closed:
            return
        stream.close()
        if stream.running:
            self.abort(sorted(stream.running))
        for request_id in stream.request_ids:
            if request_id not in stream.running:
                self._streams.pop(request_id, None)

    def discard_stream(self, stream: RequestStream) -> None:
        """Unregister a stream whose requests were never added."""
        stream.close()
        for request_id in stream.request_ids:
            self._streams.pop(request_id, None)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their final outputs are delivered."""
        request_ids = list(request_ids)
        with contextlib.suppress(EngineDeadError):  # no engine, nothing left to abort
            self._submit(_Command(lambda engine: self._abort(engine, request_ids), None))

    def abort_all(self) -> None:
        """Abort every request the engine holds (the end of the shutdown grace period)."""
        with contextlib.suppress(EngineDeadError):
            self._submit(_Command(lambda engine: self._abort(engine, list(engine.requests)), None))

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, then end the engine thread; later calls fail with EngineDeadError."""
        if self._thread is None or not self._thread.is_alive():
            return
        with self._lock:
            if self._closed_reason is None:
                self._commands.put(_Command(lambda engine: self._abort(engine, list(engine.requests)), None))
                self._commands.put(_STOP)
                self._closed_reason = "the server is shutting down"
        await asyncio.to_thread(self._thread.join, timeout)

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self._thread is None:
                raise EngineDeadError("the engine is not running")
            if self._closed_reason is not None:
                raise EngineDeadError(f"the engine is not running: {self._closed_reason}")
            self._commands.put(command)

    def _abort_stream(self, stream: RequestStream) -> None:
        if stream.running:
            self.abort(sorted(stream.running))

    def _dispatch(self, deltas: list[OutputDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            stream.put(delta)
            if delta.finished:
                del self._streams[delta.request_id]

    def _fail_streams(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.fail(error)

    # ---- engine-thread side ----

    def _run(self) -> None:
        reason = "the engine stopped"
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
            reason = f"the engine failed: {error!r}"
            self._to_loop(self._fail_streams, EngineDeadError(reason))
        finally:
            self._fail_pending(reason)

    def _fail_pending(self, reason: str) -> None:
        """Close the queue, then fail every command still in it (queued behind the stop, or after a failure)."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = reason
        for command in self._take_commands(block=False):
            if command.future is not None and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineDeadError(f"the engine is not running: {self._closed_reason}"))

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
            self._publish()
            if future is None:
                logger.exception("engine command failed")
            else:
                future.set_exception(error)
            if not isinstance(error, Exception):
                raise  # SystemExit, KeyboardInterrupt: the thread ends
            return
        # Publish the new state before the caller sees the result, so admission control never
        # sees a request in neither the engine's queues nor the pending count.
        self._publish()
        if future is not None:
            future.set_result(result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerFailedError:
            raise  # a parallel engine lost a rank: end the thread, so requests get 503 from now on
        except Exception as error:
            # A bug: fail the requests in flight (their blocks are freed) and keep serving. The streams
            # learn of the failure before the aborts arrive, so their readers get the error, not "abort".
            logger.exception("engine step failed; aborting %d request(s)", len(self.engine.requests))
            self._to_loop(self._fail_streams, RuntimeError(f"engine step failed: {type(error).__name__}"))
            self._abort(self.engine, list(self.engine.requests))
            return
        self._publish()
        self._send(outputs)

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        outputs = [output for output in map(engine.abort_request, request_ids) if output is not None]
        self._publish()
        self._send(outputs)

    def _send(self, outputs: list[RequestOutput]) -> None:
        deltas = [delta for delta in map(self._deltas.delta, outputs) if delta is not None]
        if deltas:
            self._to_loop(self._dispatch, deltas)

    def _publish(self) -> None:
        self.metrics = collect_engine_metrics(self.engine)
        self.waiting_tokens = sum(seq.num_tokens for seq in self.engine.scheduler.waiting)

    def _to_loop(self, function: Callable, argument: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(function, argument)
