"""Server state shared by the handlers, admission control, and one HTTP request's generation.

`ServerContext.admit` is the one way a handler gets engine requests: it checks that the server
accepts work (not draining, engine alive, waiting queue not full), adds the prompts on the engine
thread, and returns a `Generation` that yields their outputs and keeps the request metrics.
A `Generation` must be closed (its handler does it in `finally`): closing aborts whatever has not
finished, which is how a client that went away frees its KV blocks.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from octavo.runtime.engine import LLMEngine
from octavo.runtime.outputs import RequestOutput
from octavo.serve.admission import AddedPrompt
from octavo.serve.async_engine import AsyncEngine, RequestStream
from octavo.serve.errors import APIError
from octavo.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

AddFunction = Callable[[LLMEngine, list[str]], list[AddedPrompt]]


@dataclass
class ServerSettings:
    """What `octavo serve` was started with, beyond the engine options."""

    model_name: str
    api_key: str | None = None
    max_waiting: int | None = None
    grace_period_s: float = 30.0
    retry_after_s: int = 1


class ServerContext:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(lambda: engine.metrics, settings.model_name)
        self.draining = False
        self.num_pending = 0  # requests being added: in neither the engine's queues nor finished
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is absent or the served model's name."""
        if model is not None and model != self.settings.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"`{self.settings.model_name}`.", "not_found_error", "model", "model_not_found")

    def check_accepting(self, num_requests: int) -> None:
        """503 (with Retry-After) while shutting down, without an engine, or when the queue is full."""
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", headers=retry)
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", "service_unavailable", headers=retry)
        limit = self.settings.max_waiting
        waiting = self.engine.metrics.num_waiting + self.num_pending
        if limit is not None and waiting + num_requests > limit:
            raise APIError(503, f"the server is busy: {waiting} requests are waiting (--max-waiting {limit}); "
                                f"retry later", "service_unavailable", code="queue_full", headers=retry)

    async def admit(self, num_requests: int, samples_per_prompt: int, add: AddFunction,
                    arrival: float) -> Generation:
        """Add `num_requests` engine requests with `add(engine, request_ids)` on the engine thread."""
        self.check_accepting(num_requests)
        base = uuid.uuid4().hex
        request_ids = [f"{base}-{index}" for index in range(num_requests)]
        stream = self.engine.open_stream(request_ids)
        self.num_pending += num_requests
        try:
            added = await self.engine.call(lambda engine: add(engine, request_ids))
        except BaseException:
            self.engine.close_stream(stream)
            raise
        finally:
            self.num_pending -= num_requests
        self.metrics.prompt_tokens.inc(sum(len(item.prompt_token_ids) for item in added))
        return Generation(self, base, stream, added, samples_per_prompt, arrival)


class Generation:
    """The engine requests of one HTTP request (one per prompt) as they run."""

    def __init__(self, context: ServerContext, base_id: str, stream: RequestStream, added: list[AddedPrompt],
                 samples_per_prompt: int, arrival: float):
        self.context = context
        self.base_id = base_id
        self.stream = stream
        self.added = added
        self.samples_per_prompt = samples_per_prompt
        self.arrival = arrival
        self.prompt_index = {item.request_id: index for index, item in enumerate(added)}
        self.finals: dict[str, RequestOutput] = {}
        self._last_token_time: float | None = None
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.stream.finished

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(item.prompt_token_ids) for item in self.added)

    async def next_output(self) -> tuple[int, RequestOutput]:
        """The next output of one of the prompts, with the prompt's index."""
        output = await self.stream.next_output()
        self._observe(output)
        return self.prompt_index[output.request_id], output

    async def final_outputs(self) -> list[RequestOutput]:
        """Run to the end; the final output of every prompt, in prompt order."""
        while not self.finished:
            await self.next_output()
        return [self.finals[item.request_id] for item in self.added]

    def close(self) -> None:
        """Abort what has not finished (idempotent); counts it as finished by "abort"."""
        if self._closed:
            return
        self._closed = True
        unfinished = len(self.stream.unfinished)
        self.context.engine.close_stream(self.stream)
        if unfinished:
            logger.info("request %s ended before its %d prompt(s) finished; aborted", self.base_id, unfinished)
            self.context.metrics.finished_samples.labels("abort").inc(unfinished * self.samples_per_prompt)
            self.context.metrics.e2e_latency.observe(time.monotonic() - self.arrival)

    def _observe(self, output: RequestOutput) -> None:
        metrics = self.context.metrics
        now = time.monotonic()
        new_tokens = sum(len(completion.delta_token_ids) for completion in output.outputs)
        if new_tokens:
            metrics.generation_tokens.inc(new_tokens)
            if self._last_token_time is None:
                metrics.time_to_first_token.observe(now - self.arrival)
            else:
                metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        if output.finished:
            self.finals[output.request_id] = output
            for completion in output.outputs:
                metrics.finished_samples.labels(completion.finish_reason or "abort").inc()
            if self.finished:
                metrics.e2e_latency.observe(now - self.arrival)
