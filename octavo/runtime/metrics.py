"""Engine metrics: a point-in-time snapshot of the scheduler and the KV block pool.

The server publishes these as Prometheus gauges and counters; `octavo bench` and tests read them too.
Counts of requests are counts of distinct request ids (a request with n parallel samples counts once
per queue it has a sample in), as vLLM's `num_requests_running` / `num_requests_waiting` do.
"""

from __future__ import annotations

from dataclasses import dataclass

from octavo.runtime.spec_decode.metrics import SpecDecodeMetrics


@dataclass
class EngineMetrics:
    """One snapshot of the engine's state.

    - ``num_running`` / ``num_waiting``: requests with a sample in the running / waiting queue;
      ``num_swapped``: requests with a sample preempted to the host pool (swap preemption).
    - ``kv_blocks_total``: blocks in the pool; ``kv_blocks_used``: blocks some sequence references;
      ``kv_blocks_free``: ``total - used``, the blocks an allocation can take (never used, or cached);
      ``kv_blocks_cached``: the free blocks that still hold reusable prefix-cache contents.
      "Every block free or merely cached" is ``kv_blocks_used == 0``.
    - ``kv_usage``: ``kv_blocks_used / kv_blocks_total`` in [0, 1].
    - ``num_preemptions``: preemptions since the engine started (cumulative).
    - ``prefix_cache_queries_tokens`` / ``prefix_cache_hits_tokens``: prompt tokens looked up in / found in
      the prefix cache since the engine started (cumulative).
    - ``speculative``: speculative decoding counters (None when it is off).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    speculative: SpecDecodeMetrics | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens since start; 0 when nothing was queried."""
        if not self.prefix_cache_queries_tokens:
            return 0.0
        return self.prefix_cache_hits_tokens / self.prefix_cache_queries_tokens


def collect_engine_metrics(engine) -> EngineMetrics:
    """Read the snapshot from `engine.scheduler` and `engine.block_manager`.

    Call it from the thread that owns the engine: the queues are read without a lock.
    """
    scheduler = engine.scheduler
    manager = engine.block_manager
    total = manager.num_blocks
    used = manager.num_used_blocks
    cached = manager.num_cached_blocks
    return EngineMetrics(
        num_running=len({seq.request_id for seq in scheduler.running}),
        num_waiting=len({seq.request_id for seq in scheduler.waiting}),
        num_swapped=len({seq.request_id for seq in scheduler.swapped}),
        kv_blocks_total=total,
        kv_blocks_used=used,
        kv_blocks_free=total - used,
        kv_blocks_cached=cached,
        kv_usage=used / total if total else 0.0,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries_tokens=manager.prefix_cache_queries_tokens,
        prefix_cache_hits_tokens=manager.prefix_cache_hits_tokens,
        speculative=engine.speculator.metrics() if getattr(engine, "speculator", None) is not None else None,
    )
