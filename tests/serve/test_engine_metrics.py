"""collect_engine_metrics (octavo/runtime/metrics.py) against the engine's own queues and block pool."""

from __future__ import annotations

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.metrics import collect_engine_metrics
from octavo.runtime.sampling_params import SamplingParams


def blocks_in_use(engine: LLMEngine) -> int:
    return len({block for seq in engine.scheduler.running for block in seq.block_table})


def test_metrics_follow_queues_blocks_and_preemptions(tiny_llama_artifact):
    engine = LLMEngine(tiny_llama_artifact, EngineConfig(num_kv_blocks=8, max_num_seqs=2))
    idle = collect_engine_metrics(engine)
    assert (idle.num_running, idle.num_waiting, idle.kv_blocks_used, idle.kv_usage) == (0, 0, 0, 0.0)
    assert idle.kv_blocks_total == idle.kv_blocks_free == 8
    assert idle.prefix_cache_hit_rate == 0.0

    params = SamplingParams(temperature=0.8, seed=0, max_tokens=60, ignore_eos=True)
    for index in range(3):
        engine.add_request(list(range(100 * index + 100, 100 * index + 120)), params, request_id=f"r{index}")
    queued = collect_engine_metrics(engine)
    assert (queued.num_running, queued.num_waiting) == (0, 3)

    engine.step()
    running = collect_engine_metrics(engine)
    assert (running.num_running, running.num_waiting) == (2, 1)  # max_num_seqs 2
    assert running.kv_blocks_used == blocks_in_use(engine) > 0
    assert running.kv_blocks_free == 8 - running.kv_blocks_used
    assert running.kv_usage == running.kv_blocks_used / 8

    preempted = False
    while engine.has_unfinished_requests() and not preempted:
        engine.step()
        preempted = engine.scheduler.num_preemptions > 0  # 8 blocks cannot hold 2 x 80 tokens
    assert collect_engine_metrics(engine).num_preemptions == engine.scheduler.num_preemptions > 0

    for index in range(3):
        engine.abort_request(f"r{index}")
    done = collect_engine_metrics(engine)
    assert (done.num_running, done.num_waiting) == (0, 0)
    assert done.kv_blocks_used == 0 and done.kv_blocks_free == 8  # every block free or merely cached
    assert done.kv_blocks_cached == engine.block_manager.num_cached_blocks
