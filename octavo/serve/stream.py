"""What one HTTP request reads from the engine: per-step deltas through a bounded buffer.

The engine reports each request that changed as a snapshot of the whole request (every token id,
the whole text, every logprob so far). Queuing snapshots for a reader that falls behind would hold
memory quadratic in the output length; instead the engine thread turns each snapshot into an
`OutputDelta` (the new tokens, the new text and their logprobs, per sample) and keeps the whole
snapshot only once, when the request has finished (non-streaming bodies and usage read it).

A `RequestStream` buffers the deltas of the engine requests one HTTP request made until its reader
takes them. Its backlog is counted in entries (a token, plus one per logprob alternative it carries);
past `max_backlog` the reader has fallen too far behind: the buffer is dropped, `on_overflow` aborts
the requests, and the reader gets `StreamBacklogError` once it asks for more.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from octavo.runtime.outputs import Logprob, RequestOutput

DEFAULT_MAX_BACKLOG = 8192
"""Entries a streaming response may have waiting for its client before the client counts as too slow."""


class StreamBacklogError(Exception):
    """The client read the stream too slowly: its backlog passed the limit and the request was aborted."""


@dataclass
class SampleDelta:
    """What one sample (one of the n) produced since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class OutputDelta:
    """What one engine request produced in one step. `final` is its whole output, set once it finished."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    final: RequestOutput | None = None

    @property
    def num_entries(self) -> int:
        """Its weight in a backlog: one per token, plus one per logprob alternative."""
        entries = 0
        for sample in self.samples:
            entries += len(sample.token_ids)
            if sample.logprobs is not None:
                entries += sum(len(position) for position in sample.logprobs)
        return entries


class DeltaTracker:
    """Turns snapshots into deltas; lives on the engine thread and remembers which samples were reported finished."""

    def __init__(self) -> None:
        self._finished_samples: dict[str, set[int]] = {}

    def delta(self, output: RequestOutput) -> OutputDelta | None:
        """The news in `output`, or None when there is none (a prefill chunk that sampled nothing)."""
        reported = self._finished_samples.setdefault(output.request_id, set())
        samples = []
        for completion in output.outputs:
            new_ids = completion.delta_token_ids
            newly_finished = completion.finish_reason is not None and completion.index not in reported
            if not (new_ids or completion.delta_text or newly_finished):
                continue
            logprobs = None
            if completion.logprobs is not None:
                logprobs = completion.logprobs[len(completion.logprobs) - len(new_ids):]
            samples.append(SampleDelta(completion.index, completion.delta_text, list(new_ids), logprobs,
                                       completion.finish_reason if newly_finished else None,
                                       completion.stop_reason if newly_finished else None))
            if newly_finished:
                reported.add(completion.index)
        if output.finished:
            del self._finished_samples[output.request_id]
            return OutputDelta(output.request_id, samples, True, output.prompt_logprobs, output)
        if not samples:
            return None
        return OutputDelta(output.request_id, samples, False, output.prompt_logprobs)


class RequestStream:
    """The deltas of the engine requests one HTTP request made, in step order; lives on the event loop.

    `running`: requests the engine has not finished. `unread`: requests whose final delta the reader
    has not taken. `on_output` sees every delta as it arrives (metrics), whether or not anyone reads.
    """

    def __init__(self, request_ids: Iterable[str], max_backlog: int = DEFAULT_MAX_BACKLOG,
                 on_output: Callable[[OutputDelta], None] | None = None,
                 on_overflow: Callable[[RequestStream], None] | None = None):
        self.request_ids = list(request_ids)
        self.running = set(self.request_ids)
        self.unread = set(self.request_ids)
        self.finals: dict[str, RequestOutput] = {}
        self.max_backlog = max_backlog
        self.on_output = on_output
        self.on_overflow = on_overflow
        self.closed = False
        self._buffer: deque[OutputDelta] = deque()
        self._backlog = 0
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        """The reader has taken the final delta of every request."""
        return not self.unread

    @property
    def backlog(self) -> int:
        return self._backlog

    def put(self, delta: OutputDelta) -> None:
        if delta.finished:
            self.running.discard(delta.request_id)
            self.finals[delta.request_id] = delta.final
        if self.on_output is not None:
            self.on_output(delta)
        if self.closed or self._error is not None:
            return
        self._buffer.append(delta)
        self._backlog += delta.num_entries
        if self._backlog > self.max_backlog:
            self._overflow()
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` after what is buffered (the engine failed)."""
        if self._error is None:
            self._error = error
        self._ready.set()

    def close(self) -> None:
        """The reader is gone: drop what is buffered and ignore what still arrives (metrics still see it)."""
        self.closed = True
        self._buffer.clear()
        self._backlog = 0

    async def next_delta(self) -> OutputDelta:
        """The next delta; raises the stream's error once the buffer is empty."""
        while not self._buffer:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
        delta = self._buffer.popleft()
        self._backlog -= delta.num_entries
        if delta.finished:
            self.unread.discard(delta.request_id)
        return delta

    def _overflow(self) -> None:
        limit, backlog = self.max_backlog, self._backlog
        self._buffer.clear()
        self._backlog = 0
        self._error = StreamBacklogError(
            f"the client read the stream too slowly: {backlog} entries (tokens and their logprobs) were waiting to "
            f"be sent, more than the server's limit of {limit}; the request was aborted")
        if self.on_overflow is not None:
            self.on_overflow(self)
