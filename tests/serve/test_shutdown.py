"""SIGTERM: stop accepting, let in-flight requests finish within the grace period, abort the rest, exit 0."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.serve.server_process import start_server, stream_events

GRACE_PERIOD_S = 5.0
LONG_SAMPLES = 32


def test_sigterm_drains_then_aborts_and_exits_0(tiny_llama_artifact, tmp_path):
    server = start_server(tiny_llama_artifact, tmp_path, "--grace-period", str(GRACE_PERIOD_S),
                          "--num-kv-blocks", "1200")
    # In flight at SIGTERM with 3 steps to go: it finishes within the grace period even on a busy machine.
    short_body = {"model": server.model, "prompt": "Short", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    # 32 samples x 480 tokens (top-p sorts the vocabulary every step): far more than fits in the grace period.
    long_body = {"model": server.model, "prompt": "Long", "max_tokens": 480, "n": LONG_SAMPLES, "temperature": 1.0,
                 "top_p": 0.9, "ignore_eos": True, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(stream_events(client, server.url, body, first_event=event))
                     for body, event in zip((short_body, long_body), started, strict=True)]
            await asyncio.gather(*(event.wait() for event in started))
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.5)
            try:
                async with httpx.AsyncClient(timeout=5) as fresh:  # a new connection
                    refused = (await fresh.get(f"{server.url}/health")).status_code == 503
            except httpx.ConnectError:
                refused = True
            short_events, long_events = await asyncio.gather(*tasks)
            return short_events, long_events, signalled, refused

    try:
        short_events, long_events, signalled, refused = asyncio.run(scenario())
        code = server.process.wait(timeout=GRACE_PERIOD_S + 30)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    exited = time.monotonic()
    assert code == 0, server.log()[-3000:]
    assert "Traceback" not in server.log(), server.log()[-5000:]
    assert refused, "a new request was served after SIGTERM"
    # The short request finished normally during the grace period.
    assert short_events[-1] == "[DONE]"
    assert short_events[-2]["usage"]["completion_tokens"] == 4
    assert [choice["finish_reason"] for event in short_events[:-2] for choice in event["choices"]][-1] == "length"
    # The long one was still running when the grace period ended: every sample was aborted, the stream closed.
    assert long_events[-1] == "[DONE]"
    finish = {choice["index"]: choice["finish_reason"] for event in long_events[:-1] for choice in event["choices"]
              if choice["finish_reason"]}
    assert finish == dict.fromkeys(range(LONG_SAMPLES), "abort")
    assert exited - signalled < GRACE_PERIOD_S + 20
