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
    engine.add_request(list(range(100, 120)), params.clone(n=2), request_id="pair")
    engine.add_request(list(range(300, 310)), params, request_id="single")
    queued = collect_engine_metrics(engine)
    assert (queued.num_running, queued.num_waiting) == (0, 2)  # requests, not sequences

    engine.step()
    running = collect_engine_metrics(engine)
    assert (running.num_running, running.num_waiting) == (1, 1)  # max_num_seqs 2: the pair runs
    assert running.kv_blocks_used == blocks_in_use(engine) > 0
    assert running.kv_blocks_free == 8 - running.kv_blocks_used
    assert running.kv_usage == running.kv_blocks_used / 8

    preempted = False
    while engine.has_unfinished_requests() and not preempted:
        engine.step()
        preempted = engine.scheduler.num_preemptions > 0  # 8 blocks cannot hold 2 x 80 tokens
    assert collect_engine_metrics(engine).num_preemptions == engine.scheduler.num_preemptions > 0

    for request_id in ("pair", "single"):
        engine.abort_request(request_id)
    done = collect_engine_metrics(engine)
    assert (done.num_running, done.num_waiting) == (0, 0)
    assert done.kv_blocks_used == done.kv_blocks_cached  # every block free or merely cached
    assert done.kv_blocks_free == 8 - done.kv_blocks_used
