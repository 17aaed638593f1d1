"""Server state shared by the handlers, admission control, and one HTTP request's generation.

`ServerContext.admit` is the one way a handler gets engine requests: it checks that the server
accepts work (not draining, engine alive, waiting queue not full), tokenizes on the tokenizer
threads, checks the lengths and the waiting tokens, adds the prompts on the engine thread, and
returns a `Generation` that yields their outputs. A `Generation` must be closed (its handler does it
in `finally`): closing aborts whatever still runs, which is how a client that went away frees its
KV blocks. Request metrics are kept as outputs arrive from the engine (`RequestObserver`), so a
request counts as aborted only when the engine really aborted it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.serve.admission import AddedPrompt, Capacity, add_prompts, fit_max_tokens
from octavo.serve.async_engine import AsyncEngine
from octavo.serve.defaults import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_WORKERS
from octavo.serve.errors import APIError
from octavo.serve.metrics import ServerMetrics
from octavo.serve.prompt_limits import CharacterBound
from octavo.serve.stream import OutputDelta, RequestStream
from octavo.serve.tokenization import EncodedPrompt, PromptEncoder
from octavo.serve.tool_parsers import tool_parser

logger = logging.getLogger(__name__)

EncodeFunction = Callable[[Any], list[EncodedPrompt]]


@dataclass
class ServerSettings:
    """What `octavo serve` was started with, beyond the engine options.

    `max_waiting_tokens` None means the KV pool's token slots (see `ServerContext.waiting_token_limit`).
    `tool_call_parser`: the format tool calls are read in with tool_choice "auto" (`tool_parsers`; "auto"
    picks it from the chat template).
    """

    model_name: str
    api_key: str | None = None
    max_waiting: int | None = None
    max_waiting_tokens: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tokenizer_threads: int = DEFAULT_WORKERS
    grace_period_s: float = 30.0
    retry_after_s: int = 1
    tool_call_parser: str = "auto"


class ServerContext:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(lambda: engine.metrics, settings.model_name)
        tokenizer = engine.engine.tokenizer
        self.tool_parser = tool_parser(settings.tool_call_parser, getattr(tokenizer, "chat_template", None))
        # The grammar engine reads the vocabulary now, before any other thread uses the tokenizer.
        engine.engine.structured.grammars.compiler()
        self.encoder = PromptEncoder(tokenizer, settings.tokenizer_threads)
        self.capacity = Capacity.of(engine.engine)
        self.character_bound = CharacterBound.of(engine.engine.tokenizer)
        self.waiting_token_limit = settings.max_waiting_tokens or kv_token_slots(engine)
        self.draining = False
        self.num_pending = 0  # requests admitted, not in the engine's queues yet (being tokenized or added)
        self.pending_tokens = 0  # their tokens, once tokenized
        self.created = int(time.time())

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model, or no model given); 404 for another name."""
        if model is None or model == self.settings.model_name:
            return None
        lora = self.engine.engine.lora
        if lora is not None and model in lora.slots:
            return model
        adapters = f" and the LoRA adapters {', '.join(sorted(lora.slots))}" if lora is not None and lora.slots else ""
        raise APIError(404, f"The model `{model}` does not exist. This server serves "
                            f"`{self.settings.model_name}`{adapters}.", "not_found_error", "model", "model_not_found")

    def check_accepting(self, num_requests: int) -> None:
        """503 (with Retry-After) while shutting down, without an engine, or when the queue is full."""
        if self.draining:
            raise self._unavailable("the server is shutting down")
        if not self.engine.is_alive:
            raise self._unavailable("the engine is not running")
        limit = self.settings.max_waiting
        waiting = self.engine.metrics.num_waiting + self.num_pending
        if limit is not None and waiting + num_requests > limit:
            raise self._unavailable(f"the server is busy: {waiting} requests are waiting (--max-waiting {limit}); "
                                    f"retry later", code="queue_full")

    def check_waiting_tokens(self, num_tokens: int) -> None:
        """503 when the waiting queue would hold more tokens than the limit (an empty queue takes anything)."""
        waiting = self.engine.waiting_tokens + self.pending_tokens
        if waiting and waiting + num_tokens > self.waiting_token_limit:
            raise self._unavailable(f"the server is busy: {waiting} prompt tokens are waiting and this request "
                                    f"adds {num_tokens}, more than the limit of {self.waiting_token_limit} "
                                    f"(--max-waiting-tokens); retry later", code="queue_full")

    async def admit(self, num_requests: int, params: SamplingParams, encode: EncodeFunction, arrival: float,
                    prompt_field: str = "prompt", lora: str | None = None) -> Generation:
        """Tokenize with `encode(tokenizer)` off the engine thread, check, and add `num_requests` requests
        (under the LoRA adapter `lora`, None for the base model)."""
        self.check_accepting(num_requests)
        self.num_pending += num_requests
        try:
            encoded = await self.encoder.run(encode)
            limits = [fit_max_tokens(self.capacity, len(prompt.token_ids), params.max_tokens, prompt_field)
                      for prompt in encoded]
            num_tokens = sum(len(prompt.token_ids) for prompt in encoded)
            self.check_waiting_tokens(num_tokens)
            self.pending_tokens += num_tokens
            try:
                return await self._add(encoded, params, limits, arrival, lora)
            finally:
                self.pending_tokens -= num_tokens
        finally:
            self.num_pending -= num_requests

    async def _add(self, encoded: list[EncodedPrompt], params: SamplingParams, limits: list[int],
                   arrival: float, lora: str | None) -> Generation:
        base = uuid.uuid4().hex
        request_ids = [f"{base}-{index}" for index in range(len(encoded))]
        observer = RequestObserver(self.metrics, arrival, params.n, len(request_ids))
        stream = self.engine.open_stream(request_ids, observer.observe)
        try:
            added = await self.engine.call(lambda engine: add_prompts(engine, request_ids, encoded, params, limits,
                                                                      lora))
        except BaseException:
            self.engine.discard_stream(stream)
            self.engine.abort(request_ids)  # cancelled while being added: nobody will read them
            raise
        self.metrics.prompt_tokens.inc(sum(len(item.prompt_token_ids) for item in added))
        return Generation(self, base, stream, added)

    def _unavailable(self, message: str, code: str | None = None) -> APIError:
        return APIError(503, message, "service_unavailable", code=code,
                        headers={"Retry-After": str(self.settings.retry_after_s)})


def kv_token_slots(engine: AsyncEngine) -> int:
    """Token slots of the KV pool: the default limit on tokens waiting to start.

    A waiting queue holding more than one whole pool's worth of prompt tokens could not start even
    if everything running finished at once; a request past that would wait for more than a full
    turnover of the pool, so it is better told to retry (503) than queued.
    """
    manager = engine.engine.block_manager
    return manager.num_blocks * manager.block_size


class RequestObserver:
    """Request metrics of one HTTP request, updated as its outputs arrive from the engine."""

    def __init__(self, metrics: ServerMetrics, arrival: float, samples_per_prompt: int, num_requests: int):
        self.metrics = metrics
        self.arrival = arrival
        self.samples_per_prompt = samples_per_prompt
        self.num_running = num_requests
        self._last_token_time: float | None = None

    def observe(self, delta: OutputDelta) -> None:
        now = time.monotonic()
        new_tokens = sum(len(sample.token_ids) for sample in delta.samples)
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if self._last_token_time is None:
                self.metrics.time_to_first_token.observe(now - self.arrival)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        for sample in delta.samples:
            if sample.finish_reason is not None:
                self.metrics.finished_samples.labels(sample.finish_reason).inc()
        if delta.finished:
            # Samples never forked from sample 0 (it was aborted during its prompt) were aborted too.
            never_started = self.samples_per_prompt - len(delta.final.outputs)
            if never_started:
                self.metrics.finished_samples.labels("abort").inc(never_started)
            self.num_running -= 1
            if not self.num_running:
                self.metrics.e2e_latency.observe(now - self.arrival)


class Generation:
    """The engine requests of one HTTP request (one per prompt) as the handler reads them."""

    def __init__(self, context: ServerContext, base_id: str, stream: RequestStream, added: list[AddedPrompt]):
        self.context = context
        self.base_id = base_id
        self.stream = stream
        self.added = added
        self.prompt_index = {item.request_id: index for index, item in enumerate(added)}
        self._closed = False

    @property
    def finished(self) -> bool:
        return self.stream.finished

    @property
    def finals(self) -> dict[str, RequestOutput]:
        return self.stream.finals

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(item.prompt_token_ids) for item in self.added)

    async def next_output(self) -> tuple[int, OutputDelta]:
        """The next delta of one of the prompts, with the prompt's index."""
        delta = await self.stream.next_delta()
        return self.prompt_index[delta.request_id], delta

    async def final_outputs(self) -> list[RequestOutput]:
        """Run to the end; the final output of every prompt, in prompt order."""
        while not self.finished:
            await self.next_output()
        return [self.finals[item.request_id] for item in self.added]

    def close(self) -> None:
        """Abort what still runs (idempotent); the engine's final outputs then count the aborts."""
        if self._closed:
            return
        self._closed = True
        if self.stream.running:
            logger.info("request %s ended before %d of its prompt(s) finished; aborting them", self.base_id,
                        len(self.stream.running))
        self.context.engine.close_stream(self.stream)

