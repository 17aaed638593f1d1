"""collect_engine_metrics (octavo/runtime/metrics.py) against counts the test makes itself.

The test drives the engine and derives every expected figure on its own:
queue sizes from the requests it submitted and the outputs each step
returned, blocks in use from each running request's token count
(ceil(computed / block_size), no sharing between distinct prompts),
preemptions from sequences whose computed tokens fell back to zero, and
prefix-cache figures from the prompt lengths and the block size.
"""

from __future__ import annotations

import pytest

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact
from octavo.runtime.metrics import EngineMetrics, collect_engine_metrics
from octavo.runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import observe_recompute_preemptions

BLOCK = 16
PROMPT = 40  # 3 blocks: two sequences fill the pool of 6 when they reach 48 tokens
NUM_BLOCKS = 6


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


@pytest.fixture(scope="module")
def artifact(tiny_llama_artifact):
    """Loaded once: each test's engine has its own KV pool and block manager."""
    return load_artifact(tiny_llama_artifact)


def test_queues_blocks_and_preemptions_match_the_tests_own_counts(artifact):
    engine = LLMEngine(artifact, EngineConfig(num_kv_blocks=NUM_BLOCKS, max_num_seqs=2))
    assert collect_engine_metrics(engine) == EngineMetrics(kv_blocks_total=NUM_BLOCKS, kv_blocks_free=NUM_BLOCKS)

    params = SamplingParams(temperature=0.8, seed=0, max_tokens=60, ignore_eos=True)
    submitted = [f"r{index}" for index in range(3)]
    for index, request_id in enumerate(submitted):
        engine.add_request(list(range(100 * index + 100, 100 * index + 100 + PROMPT)), params, request_id=request_id)
    queued = collect_engine_metrics(engine)
    assert (queued.num_running, queued.num_waiting, queued.kv_blocks_used) == (0, 3, 0)

    finished: set[str] = set()
    last_computed: dict[str, int] = {}
    preemptions = steps = 0
    while preemptions == 0:  # until the 6 blocks cannot hold two sequences past 48 tokens
        assert engine.has_unfinished_requests(), "no preemption although two 96-token sequences need 12 blocks"
        outputs = engine.step()
        steps += 1
        preemptions += observe_recompute_preemptions(engine, last_computed)
        finished |= {output.request_id for output in outputs if output.finished}
        running = {output.request_id: len(output.outputs[0].token_ids) for output in outputs if not output.finished}
        # A running request holds blocks for its computed tokens: prompt + generated, less the newest token.
        used = sum(blocks_for(PROMPT + generated - 1) for generated in running.values())
        metrics = collect_engine_metrics(engine)
        assert (metrics.num_running, metrics.num_waiting) == (len(running), len(submitted) - len(finished) -
                                                              len(running)), f"step {steps}"
        assert (metrics.kv_blocks_used, metrics.kv_blocks_free) == (used, NUM_BLOCKS - used), f"step {steps}"
        assert metrics.kv_usage == used / NUM_BLOCKS
        assert metrics.num_preemptions == preemptions, f"step {steps}"
        if steps == 1:
            assert len(running) == 2, "max_num_seqs 2: the third request waits"
    for request_id in submitted:
        engine.abort_request(request_id)
    done = collect_engine_metrics(engine)
    assert (done.num_running, done.num_waiting, done.kv_blocks_used, done.kv_blocks_free) == (0, 0, 0, NUM_BLOCKS)
    assert done.num_preemptions == preemptions


def test_cached_blocks_and_prefix_hits_match_the_block_arithmetic(artifact):
    engine = LLMEngine(artifact, EngineConfig(num_kv_blocks=NUM_BLOCKS))
    prompt = list(range(300, 340))  # 40 tokens
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request(prompt, params, request_id="first")
    while engine.has_unfinished_requests():
        engine.step()
    # 40 + 10 tokens, 49 of them computed (the last sampled one never is): 3 full blocks stay cached.
    metrics = collect_engine_metrics(engine)
    assert (metrics.kv_blocks_used, metrics.kv_blocks_cached, metrics.kv_blocks_free) == (0, 3, NUM_BLOCKS)
    assert (metrics.prefix_cache_queries_tokens, metrics.prefix_cache_hits_tokens) == (40, 0)

    engine.add_request(prompt, params, request_id="again")
    engine.step()
    # The same prompt reuses its 2 full prompt blocks ((40 - 1) // 16): only 8 tokens are computed.
    assert engine.last_step.schedule.num_batched_tokens == 40 - 2 * BLOCK
    metrics = collect_engine_metrics(engine)
    assert (metrics.prefix_cache_queries_tokens, metrics.prefix_cache_hits_tokens) == (80, 32)
    assert metrics.prefix_cache_hit_rate == 32 / 80
    assert metrics.kv_blocks_used == blocks_for(40) and metrics.kv_blocks_cached == 1  # the third, output block
    engine.abort_request("again")
    assert collect_engine_metrics(engine).kv_blocks_used == 0
