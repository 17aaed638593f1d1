"""`octavo serve` of a tiny model under load: 64 concurrent streams, /health meanwhile, clients that leave or stall."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time

import httpx
import pytest

from octavo.runtime.sampling_params import SamplingParams
from tests.serve.conftest import TINY_MAX_MODEL_LEN, TINY_NUM_KV_BLOCKS
from tests.serve.server_process import scrape_metrics, stream_events

NUM_STREAMS = 64
NUM_DISCONNECTING = 32


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def workload(count: int, seed: int = 0) -> list[tuple[str | list[int], int]]:
    """(prompt, max_tokens) pairs: text prompts and token-id prompts, 4..16 output tokens."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        if index % 2:
            prompt = [rng.randrange(100, 49000) for _ in range(rng.randrange(3, 24))]
        else:
            prompt = f"Request {index}: tell me about {rng.choice(['rivers', 'compilers', 'owls', 'tea'])}"
        requests.append((prompt, 4 + index % 13))
    return requests


class HealthProbe(threading.Thread):
    """Polls /health from its own thread and records (time, latency, status) of each answer."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stopped.is_set():
                start = time.monotonic()
                status = client.get(f"{self.url}/health").status_code
                self.samples.append((start, time.monotonic() - start, status))
                self.stopped.wait(0.1)


def test_64_concurrent_streams_complete_and_equal_offline_while_health_answers(server, tiny_offline):
    requests = workload(NUM_STREAMS)
    probe = HealthProbe(server.url)

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            bodies = [{"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}
                      for prompt, max_tokens in requests]
            return await asyncio.gather(*(stream_events(client, server.url, body) for body in bodies))

    probe.start()
    started = time.monotonic()
    results = asyncio.run(run_all())
    finished = time.monotonic()
    probe.stopped.set()
    probe.join()

    expected = tiny_offline.generate([prompt for prompt, _ in requests],
                                [SamplingParams(temperature=0, max_tokens=max_tokens) for _, max_tokens in requests])
    for events, reference in zip(results, expected, strict=True):
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
        assert text == reference.outputs[0].text
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens"] == len(reference.prompt_token_ids)
        assert usage["completion_tokens"] == len(reference.outputs[0].token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    during = [(latency, status) for at, latency, status in probe.samples if started <= at <= finished]
    assert len(during) >= 3, f"/health was polled only {len(during)} times during the streams"
    assert all(status == 200 for _, status in during)
    assert max(latency for latency, _ in during) < 1.0, sorted(latency for latency, _ in during)[-5:]


def test_disconnecting_clients_free_their_blocks(server):
    before = scrape_metrics(server.url)

    async def run_all():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            bodies = [{"model": server.model, "prompt": f"Client {index} walks away", "max_tokens": 100,
                       "temperature": 0.7, "ignore_eos": True, "stream": True}
                      for index in range(NUM_DISCONNECTING)]
            return await asyncio.gather(*(stream_events(client, server.url, body, stop_after=3) for body in bodies))

    results = asyncio.run(run_all())
    assert all(len(events) == 3 and "[DONE]" not in events for events in results)
    deadline = time.monotonic() + 20
    while True:
        metrics = scrape_metrics(server.url)
        idle = (metrics["octavo_num_requests_running"] == metrics["octavo_num_requests_waiting"] == 0
                and metrics["octavo_num_requests_swapped"] == 0
                and metrics["octavo_kv_blocks_used"] == 0)  # every block free or merely cached
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, {name: value for name, value in metrics.items() if "kv" in name or "num_requests" in name}
    assert metrics["octavo_kv_blocks_total"] == TINY_NUM_KV_BLOCKS
    aborted = 'octavo_request_success_total{finish_reason="abort"}'
    assert metrics[aborted] - before.get(aborted, 0) == NUM_DISCONNECTING


def test_length_over_model_length_is_400_with_both_numbers(server):
    prompt = list(range(1000, 1100))  # 100 tokens
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": server.model, "prompt": prompt, "max_tokens": 50})
    assert response.status_code == 400
    error = response.json()["error"]
    assert f"{TINY_MAX_MODEL_LEN} tokens" in error["message"]
    assert "100 in the prompt, 50 for the completion" in error["message"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": server.model, "prompt": list(range(1000, 1200)), "max_tokens": None})
    assert response.status_code == 400
    assert "200 tokens" in response.json()["error"]["message"]


def finished_samples(metrics: dict[str, float]) -> float:
    return sum(value for name, value in metrics.items() if name.startswith("octavo_request_success_total"))


def test_a_client_that_stops_reading_is_cut_off_with_an_error_event_and_its_samples_aborted(server):
    """A stream whose client stops reading is aborted once the server holds too much for it.

    The first chunk of each of the 128 samples echoes the prompt with its top-20 logprobs (about
    7 MB in all), more than the sockets buffer (Linux caps a send buffer at 4 MiB by default, and the
    client asks for a 64 KiB receive buffer), so the server cannot hand it all over; the steps after
    it then wait in the stream's buffer until they pass the default backlog limit (8192 entries: a
    token with 20 alternatives counts 22).
    """
    before = scrape_metrics(server.url)
    body = {"model": server.model, "prompt": list(range(1000, 1100)), "echo": True, "logprobs": 20, "n": 128,
            "max_tokens": TINY_MAX_MODEL_LEN - 100, "temperature": 1.0, "ignore_eos": True, "stream": True}
    small_window = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)])
    with httpx.Client(transport=small_window, timeout=120) as client, \
            client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        deadline = time.monotonic() + 60
        while finished_samples(scrape_metrics(server.url)) - finished_samples(before) < 128:
            assert time.monotonic() < deadline, "the request neither finished nor was aborted"
            time.sleep(0.2)  # not reading
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2]), [event[:200] for event in events[-2:]]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "reader_too_slow" and "read the stream too slowly" in error["message"]
    assert "limit of 8192" in error["message"]
    after = scrape_metrics(server.url)
    aborted = 'octavo_request_success_total{finish_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 128
    assert after["octavo_kv_blocks_used"] == 0
