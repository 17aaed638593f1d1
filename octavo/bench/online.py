"""Online load generator behind `octavo bench --server URL`, shaped like `vllm bench serve`.

Requests arrive as a Poisson process of `rate` requests/s (inter-arrival times exponential with mean
1/rate, drawn from a seeded generator; rate inf sends them all at once). Each is a streaming
/v1/completions request whose prompt is the workload's token ids, greedy, with a fixed `max_tokens`
and `ignore_eos: true` (vLLM's extension), so every request generates exactly `output_len` tokens.

Per request: TTFT is from sending the request to its first chunk carrying text; ITL are the gaps
between consecutive chunks after that (percentiles over all gaps of all requests, as vLLM reports
them); TPOT is (latency - TTFT) / (output tokens - 1). Output tokens are the server's
`usage.completion_tokens`. Throughput divides by the wall time from the first send to the last end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from octavo.bench.results import BenchResult, percentile
from octavo.bench.workloads import Workload
from octavo.errors import OctavoError

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """What one request measured; `error` is set when it failed."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def arrival_offsets(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `rate` requests/s (all 0 for rate inf)."""
    if rate <= 0:
        raise OctavoError(f"--rate must be > 0 requests/s (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    generator = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += generator.expovariate(rate)
    return offsets


def served_model(url: str, api_key: str | None = None) -> dict:
    """The first model card of `GET {url}/v1/models` (id, max_model_len, vocab_size when the server says)."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=_headers(api_key), timeout=30)
    except httpx.HTTPError as error:
        raise OctavoError(f"cannot reach the server at {url}: {error}") from None
    if response.status_code != 200:
        raise OctavoError(f"GET {url}/v1/models answered {response.status_code}: {response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise OctavoError(f"the server at {url} lists no model")
    return models[0]


def online_prompts(workload: Workload, card: dict, artifact: str | None = None) -> list[list[int]]:
    """The workload's prompts for the served model, whose vocabulary size comes from the server's model
    card or, when it does not say, from the served `artifact`'s tokenizer (which a chat workload
    needs too). The ids are the ones `octavo bench ARTIFACT` sends for the same workload."""
    vocab_size = card.get("vocab_size")
    tokenizer = None
    if artifact is not None and (vocab_size is None or workload.chat_file is not None):
        from transformers import AutoTokenizer

        from octavo.ir.artifact_format import TOKENIZER_DIR

        tokenizer = AutoTokenizer.from_pretrained(Path(artifact) / TOKENIZER_DIR, local_files_only=True)
        vocab_size = vocab_size or len(tokenizer)
    if vocab_size is None:
        raise OctavoError("the server does not say its vocab_size: pass the ARTIFACT it serves")
    return workload.prompts(vocab_size, tokenizer)


async def run_online(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                     workload_name: str, api_key: str | None = None, seed: int = 0) -> BenchResult:
    """Send every prompt at its Poisson arrival time, streaming; the figures as a BenchResult."""
    offsets = arrival_offsets(len(prompts), rate, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=httpx.Timeout(None), limits=limits,
                                 headers=_headers(api_key)) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, offset in zip(prompts, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one_request(client, model, prompt, output_len)))
        records = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return _result(workload_name, records, elapsed, rate)


async def _one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> RequestRecord:
    record = RequestRecord(prompt_tokens=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "stream error")
                if not any(choice.get("text") for choice in chunk.get("choices", [])):
                    continue
                if record.ttft_s is None:
                    record.ttft_s = now - sent
                else:
                    record.chunk_gaps_s.append(now - last)
                last = now
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
    record.latency_s = time.perf_counter() - sent
    return record


def _result(workload_name: str, records: list[RequestRecord], elapsed: float, rate: float) -> BenchResult:
    succeeded = [record for record in records if record.error is None and record.ttft_s is not None]
    failed = [record for record in records if record not in succeeded]
    if not succeeded:
        reason = failed[0].error if failed else "no request was sent"
        raise OctavoError(f"every request failed; the first: {reason}")
    for record in failed:
        logger.warning("request failed: %s", record.error)
    tpots = [record.tpot_s for record in succeeded if record.tpot_s is not None]
    result = BenchResult("server", workload_name, len(succeeded), sum(record.prompt_tokens for record in succeeded),
                         sum(record.output_tokens for record in succeeded), elapsed,
                         ttft_s=[record.ttft_s for record in succeeded],
                         itl_s=[gap for record in succeeded for gap in record.chunk_gaps_s])
    result.extra["rate"] = "inf" if math.isinf(rate) else f"{rate:g} req/s"
    result.extra["achieved"] = f"{len(succeeded) / elapsed:.2f} req/s"
    if tpots:
        result.extra["TPOT"] = (f"mean {statistics.mean(tpots) * 1000:.1f}ms p50 {percentile(tpots, 50) * 1000:.1f}ms "
                                f"p99 {percentile(tpots, 99) * 1000:.1f}ms")
    result.extra["failed"] = len(failed)
    return result


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
