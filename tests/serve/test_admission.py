"""Who gets in: the API key (401 without it), the waiting-queue limits (503 with Retry-After).

The waiting queue is limited by count (--max-waiting) and by tokens: by default a request is turned
away when the prompts waiting to start would hold more tokens than the KV pool has slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import pytest

from tests.serve.server_process import running_server, scrape_metrics, stream_events

API_KEY = "sk-octavo-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


NUM_KV_BLOCKS = 16
KV_TOKEN_SLOTS = NUM_KV_BLOCKS * 16  # the tiny artifact's block size is 16


@pytest.fixture(scope="module")
def server(tiny_llama_artifact, tmp_path_factory):
    """One sequence runs at a time, at most two requests may wait, and the pool has 256 token slots."""
    with running_server(tiny_llama_artifact, tmp_path_factory.mktemp("serve-admission"), "--api-key", API_KEY,
                        "--max-waiting", "2", "--max-num-seqs", "1", "--num-kv-blocks", str(NUM_KV_BLOCKS)) as server:
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
    assert httpx.get(f"{server.url}/version", timeout=10).status_code == 200
    for path, body in [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})]:  # tokenizer work: keyed
        assert httpx.post(f"{server.url}{path}", json=body, timeout=10).status_code == 401
        assert httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=10).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=server.model, prompt="Hi", max_tokens=3).usage.completion_tokens == 3


LONG_BODY = {"model": "test-model", "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True,
             "stream": True}


async def refused_behind(server, waiting_bodies: list[dict], refused_body: dict) -> httpx.Response:
    """Keep one long request running and `waiting_bodies` waiting; the answer to `refused_body` then."""
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as client, contextlib.AsyncExitStack() as stack:
        running = asyncio.Event()
        running_task = asyncio.create_task(stream_events(client, server.url, LONG_BODY, stop_after=40,
                                                         first_event=running))
        await running.wait()  # the first request runs (max-num-seqs 1) ...
        for body in waiting_bodies:  # ... these are admitted and wait ...
            waiting = await stack.enter_async_context(client.stream("POST", f"{server.url}/v1/completions",
                                                                    json={**body, "stream": True}))
            assert waiting.status_code == 200, await waiting.aread()
        rejected = await client.post(f"{server.url}/v1/completions", json=refused_body)  # ... this is not
        running_task.cancel()
        return rejected


def wait_until_idle(server) -> None:
    """Both clients went away: the queue drains and admits again, every block free or merely cached."""
    deadline = time.monotonic() + 20
    while scrape_metrics(server.url)["octavo_num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert completion(server, AUTH).status_code == 200
    assert scrape_metrics(server.url)["octavo_kv_blocks_used"] == 0


def test_full_waiting_queue_answers_503_with_retry_after(server):
    short = {"model": server.model, "prompt": "Hi", "max_tokens": 2}
    rejected = asyncio.run(refused_behind(server, [short, short], short))
    assert rejected.status_code == 503
    assert int(rejected.headers["Retry-After"]) >= 1
    assert rejected.json()["error"]["code"] == "queue_full"
    assert "--max-waiting 2" in rejected.json()["error"]["message"]
    wait_until_idle(server)


def test_waiting_tokens_past_the_kv_pool_answer_503_with_retry_after(server):
    """200 prompt tokens wait; 100 more would pass the pool's 256 token slots (the default limit)."""
    waiting = {"model": server.model, "prompt": list(range(1000, 1200)), "max_tokens": 8}
    refused = {"model": server.model, "prompt": list(range(2000, 2100)), "max_tokens": 8}
    rejected = asyncio.run(refused_behind(server, [waiting], refused))
    assert rejected.status_code == 503, rejected.text
    assert int(rejected.headers["Retry-After"]) >= 1
    error = rejected.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "service_unavailable"
    assert f"200 prompt tokens are waiting and this request adds 100, more than the limit of {KV_TOKEN_SLOTS}" \
        in error["message"]
    wait_until_idle(server)
