"""Who gets in: the API key (401 without it), the waiting-queue limit (503 with Retry-After)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.serve.server_process import running_server, scrape_metrics, stream_events

API_KEY = "sk-octavo-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_artifact, tmp_path_factory):
    """One sequence runs at a time and at most one request may wait."""
    with running_server(tiny_llama_artifact, tmp_path_factory.mktemp("serve-admission"), "--api-key", API_KEY,
                        "--max-waiting", "1", "--max-num-seqs", "1", "--num-kv-blocks", "256") as server:
        yield server


def completion(server, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                      json={"model": server.model, "prompt": "Hello", "max_tokens": 2})


def test_api_key_is_required_on_v1_routes(server):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = completion(server, headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert completion(server, AUTH).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # probes need no key
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=server.model, prompt="Hi", max_tokens=3).usage.completion_tokens == 3


def test_full_waiting_queue_answers_503_with_retry_after(server):
    long_body = {"model": server.model, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True,
                 "stream": True}

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            running = asyncio.Event()
            running_task = asyncio.create_task(stream_events(client, server.url, long_body, stop_after=40,
                                                             first_event=running))
            await running.wait()  # the first request runs (max-num-seqs 1) ...
            async with client.stream("POST", f"{server.url}/v1/completions", json=long_body) as waiting:
                assert waiting.status_code == 200  # ... the second was admitted and waits ...
                rejected = await client.post(f"{server.url}/v1/completions",  # ... so the third is turned away
                                             json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
            running_task.cancel()
            return rejected

    rejected = asyncio.run(scenario())
    assert rejected.status_code == 503
    assert int(rejected.headers["Retry-After"]) >= 1
    assert rejected.json()["error"]["code"] == "queue_full"
    assert "--max-waiting 1" in rejected.json()["error"]["message"]
    deadline = time.monotonic() + 20  # both clients went away: the queue drains and admits again
    while scrape_metrics(server.url)["octavo_num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert completion(server, AUTH).status_code == 200
    assert scrape_metrics(server.url)["octavo_kv_blocks_used"] == 0  # every block free or merely cached
