"""`octavo bench --server`'s load generator: Poisson arrivals, and its figures against a real server."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import pytest

from octavo.bench.online import arrival_offsets, run_online
from octavo.errors import OctavoError


def test_arrivals_are_a_poisson_process():
    offsets = arrival_offsets(4000, rate=5.0, seed=1)
    gaps = [later - earlier for earlier, later in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    # Exponential inter-arrival times: mean 1/rate and standard deviation equal to the mean.
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.08)
    assert arrival_offsets(4000, rate=5.0, seed=1) == offsets
    assert arrival_offsets(3, rate=float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(OctavoError, match="rate"):
        arrival_offsets(3, rate=0)


def test_online_run_against_the_server(tiny_server):
    prompts = [[200 + index] * (4 + index) for index in range(6)]
    result = asyncio.run(run_online(tiny_server.url, tiny_server.model, prompts, output_len=5, rate=20.0,
                                    workload_name="tiny"))
    assert result.extra["failed"] == 0
    assert result.num_requests == 6 and result.prompt_tokens == sum(map(len, prompts))
    assert result.output_tokens == 6 * 5  # ignore_eos: exactly max_tokens each
    assert len(result.ttft_s) == 6 and all(0 < ttft < result.elapsed_s for ttft in result.ttft_s)
    assert 0 < len(result.itl_s) <= 6 * 4  # one gap per chunk after the first (a chunk may hold several tokens)
    assert result.line().startswith("server tiny: 6 req")


def test_unreachable_server_fails_every_request_with_a_clear_error():
    with pytest.raises(OctavoError, match="every request failed"):
        asyncio.run(run_online("http://127.0.0.1:9", "m", [[1, 2, 3]], output_len=2, rate=float("inf"),
                               workload_name="none"))
