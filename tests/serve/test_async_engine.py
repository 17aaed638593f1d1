"""AsyncEngine in-process over the tiny llama: commands never hang, slow readers are cut off, aborts are counted.

Each test drives a real LLMEngine on the engine thread from an asyncio loop, as the server does.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact
from octavo.runtime.sampling_params import SamplingParams
from octavo.serve.async_engine import AsyncEngine, EngineDeadError
from octavo.serve.context import ServerContext, ServerSettings
from octavo.serve.stream import StreamBacklogError
from octavo.serve.tokenization import encode_prompt

PROMPT = [1000 + index for index in range(12)]
WAIT_S = 60.0


class EngineThreadKilled(BaseException):
    """Raised by a command to end the engine thread, as an uncaught error in the engine would."""


@pytest.fixture(scope="module")
def engine(tiny_llama_artifact) -> LLMEngine:
    """One engine for the module; every test leaves it without requests."""
    engine = LLMEngine(load_artifact(tiny_llama_artifact), EngineConfig(num_kv_blocks=64, max_model_len=256))
    yield engine
    assert not engine.requests


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), WAIT_S))


async def until(condition, what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_commands_pending_when_the_engine_thread_dies_fail_instead_of_hanging(engine):
    async def scenario():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        entered, release = threading.Event(), threading.Event()

        def block_then_die(_):
            entered.set()
            release.wait(WAIT_S)
            raise EngineThreadKilled()

        dying = asyncio.ensure_future(async_engine.call(block_then_die))
        await asyncio.to_thread(entered.wait, WAIT_S)
        queued = [asyncio.ensure_future(async_engine.call(lambda engine: engine.num_steps)) for _ in range(3)]
        await asyncio.sleep(0)  # each call has put its command behind the blocked one
        release.set()
        with pytest.raises(EngineThreadKilled):
            await dying
        for call in queued:
            with pytest.raises(EngineDeadError, match="the engine failed"):
                await call
        assert not async_engine.is_alive
        with pytest.raises(EngineDeadError):
            await async_engine.call(lambda engine: engine.num_steps)

    run(scenario)


def test_stop_runs_the_commands_ahead_of_it_and_refuses_later_ones(engine):
    async def scenario():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        entered, release = threading.Event(), threading.Event()
        blocked = asyncio.ensure_future(async_engine.call(lambda _: (entered.set(), release.wait(WAIT_S))))
        await asyncio.to_thread(entered.wait, WAIT_S)
        ahead = asyncio.ensure_future(async_engine.call(lambda engine: "ran"))
        await asyncio.sleep(0)
        stopping = asyncio.ensure_future(async_engine.stop())
        await asyncio.sleep(0)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await async_engine.call(lambda engine: "too late")
        release.set()
        await stopping
        assert (await blocked)[1] is True
        assert await ahead == "ran"
        assert not async_engine.is_alive

    run(scenario)


def test_reader_too_far_behind_is_aborted_with_a_clear_error_and_one_that_keeps_up_is_not(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def scenario():
        async_engine = AsyncEngine(engine, max_stream_backlog=24)  # 24 tokens behind at most
        async_engine.start()
        slow = async_engine.open_stream(["slow"])
        await async_engine.call(lambda engine: engine.add_request(PROMPT, params, request_id="slow"))
        await until(lambda: not slow.running, "the slow request to end")
        with pytest.raises(StreamBacklogError, match=r"read the stream too slowly.*limit of 24.*aborted"):
            await slow.next_delta()
        aborted = slow.finals["slow"].outputs[0]
        assert aborted.finish_reason == "abort" and 24 < len(aborted.token_ids) < 200
        assert async_engine.metrics.kv_blocks_used == 0

        keeping_up = async_engine.open_stream(["fast"])
        await async_engine.call(lambda engine: engine.add_request(PROMPT, params, request_id="fast"))
        tokens = []
        while not keeping_up.finished:
            delta = await keeping_up.next_delta()
            tokens += delta.samples[0].token_ids if delta.samples else []
        assert len(tokens) == 200 and keeping_up.finals["fast"].outputs[0].finish_reason == "length"
        await async_engine.stop()

    run(scenario)


def test_tokenizing_a_huge_prompt_does_not_stop_the_engine_thread(engine):
    """While a worker thread tokenizes ~250k characters, a decoding request keeps producing tokens.

    Had the tokenizer held the engine thread (or the GIL, which the engine thread and the event loop
    both need), no delta could arrive until the tokenization ended.
    """
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 4000
    params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    started, finished = threading.Event(), threading.Event()

    def tokenize(tokenizer):
        started.set()
        encoded = encode_prompt(tokenizer, text, want_text=False)
        finished.set()
        return encoded

    async def scenario():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        context = ServerContext(async_engine, ServerSettings("m"))
        stream = async_engine.open_stream(["decoding"])
        await async_engine.call(lambda engine: engine.add_request(PROMPT, params, request_id="decoding"))
        await stream.next_delta()  # decoding has started
        tokenizing = asyncio.ensure_future(context.encoder.run(tokenize))
        await asyncio.to_thread(started.wait, WAIT_S)
        for _ in range(10):
            await stream.next_delta()
        assert not finished.is_set(), "no tokens were decoded while the prompt was tokenized"
        assert len((await tokenizing).token_ids) > 25_000
        async_engine.close_stream(stream)
        await until(lambda: not stream.running, "the decoding request to be aborted")
        await async_engine.stop()
        context.encoder.shutdown()

    run(scenario)


def test_requests_finished_but_unread_are_not_counted_as_aborts(engine):
    async def scenario():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        context = ServerContext(async_engine, ServerSettings("m"))

        def encode(tokenizer):
            return [encode_prompt(tokenizer, PROMPT, want_text=False)]

        def finished(reason: str) -> float:
            return context.metrics.registry.get_sample_value("octavo_request_success_total",
                                                             {"finish_reason": reason}) or 0.0

        short = SamplingParams(temperature=0.8, seed=1, max_tokens=3, n=2, ignore_eos=True)
        done = await context.admit(1, short, encode, arrival=0.0)
        await until(lambda: not done.stream.running, "the short request to finish")
        done.close()  # its client went away without reading a single output
        assert (finished("length"), finished("abort")) == (2, 0)

        long = SamplingParams(temperature=0.8, seed=1, max_tokens=200, n=2, ignore_eos=True)
        running = await context.admit(1, long, encode, arrival=0.0)
        await running.next_output()
        running.close()
        await until(lambda: not running.stream.running, "the long request to be aborted")
        assert (finished("length"), finished("abort")) == (2, 2)
        await async_engine.stop()
        context.encoder.shutdown()

    run(scenario)
