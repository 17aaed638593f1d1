"""Prometheus metrics of one server (its own CollectorRegistry, so two apps in a process never mix).

Request-level series are updated by the handlers as outputs arrive; engine-level series (queues,
KV blocks, preemptions, prefix cache) are read from the AsyncEngine's latest `EngineMetrics`
snapshot at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from octavo.runtime.metrics import EngineMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector(Collector):
    """Gauges and counters read from the engine snapshot when /metrics is scraped."""

    def __init__(self, snapshot: Callable[[], EngineMetrics], model_name: str):
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        metrics = self.snapshot()
        gauges = {
            "octavo_num_requests_running": ("Requests with a sample in the running queue", metrics.num_running),
            "octavo_num_requests_waiting": ("Requests with a sample in the waiting queue", metrics.num_waiting),
            "octavo_num_requests_swapped": ("Requests with a sample swapped out to host memory",
                                            metrics.num_swapped),
            "octavo_kv_cache_usage_perc": ("Share of KV blocks in use, 0..1", metrics.kv_usage),
            "octavo_kv_blocks_total": ("KV blocks in the pool", metrics.kv_blocks_total),
            "octavo_kv_blocks_used": ("KV blocks referenced by a sequence", metrics.kv_blocks_used),
            "octavo_kv_blocks_free": ("KV blocks not referenced by any sequence", metrics.kv_blocks_free),
            "octavo_kv_blocks_cached": ("Unreferenced KV blocks kept for the prefix cache",
                                        metrics.kv_blocks_cached),
            "octavo_prefix_cache_hit_rate": ("Prompt tokens found in the prefix cache / tokens looked up",
                                             metrics.prefix_cache_hit_rate),
        }
        for name, (documentation, value) in gauges.items():
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        counters = {
            "octavo_num_preemptions": ("Sequences preempted since start", metrics.num_preemptions),
            "octavo_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                            metrics.prefix_cache_queries_tokens),
            "octavo_prefix_cache_hits": ("Prompt tokens found in the prefix cache", metrics.prefix_cache_hits_tokens),
        }
        for name, (documentation, value) in counters.items():
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        if metrics.speculative is not None:
            yield from self._speculative(metrics.speculative)

    def _speculative(self, spec) -> Iterator[Metric]:
        """Speculative decoding: what was proposed and accepted, and (separately) what it bought in time."""
        counters = {
            "octavo_spec_decode_num_drafts": ("Verifications of proposals (sequence x step)", spec.num_verifications),
            "octavo_spec_decode_num_draft_tokens": ("Proposed tokens verified", spec.proposed_tokens),
            "octavo_spec_decode_num_accepted_tokens": ("Proposed tokens accepted", spec.accepted_tokens),
            "octavo_spec_decode_num_emitted_tokens": ("Tokens emitted by verifications", spec.emitted_tokens),
        }
        for name, (documentation, value) in counters.items():
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        per_position = CounterMetricFamily("octavo_spec_decode_num_accepted_tokens_per_pos",
                                           "Proposed tokens accepted, by position in the proposal",
                                           labels=["model_name", "position"])
        for position, accepted in enumerate(spec.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], accepted)
        yield per_position
        gauges = {
            "octavo_spec_decode_acceptance_rate": ("Accepted / proposed tokens", spec.acceptance_rate),
            "octavo_spec_decode_mean_accepted_length": ("Accepted tokens per verification",
                                                        spec.mean_accepted_length),
            "octavo_spec_decode_tokens_per_step": ("Tokens a verifying sequence gains per target step",
                                                   spec.tokens_per_step),
            "octavo_spec_decode_speedup": ("Estimated time without speculation / measured time, same tokens",
                                           spec.speedup),
        }
        for name, (documentation, value) in gauges.items():
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge


class ServerMetrics:
    """The server's registry and the request-level series."""

    def __init__(self, snapshot: Callable[[], EngineMetrics], model_name: str):
        self.registry = CollectorRegistry()
        self.http_requests = Counter("octavo_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=self.registry)
        self.finished_samples = Counter("octavo_request_success", "Finished samples by finish reason",
                                        ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("octavo_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("octavo_generation_tokens", "Generated tokens", registry=self.registry)
        self.time_to_first_token = Histogram("octavo_time_to_first_token_seconds",
                                             "From request arrival to its first generated token",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("octavo_inter_token_latency_seconds",
                                             "Between consecutive engine outputs of a request that carry tokens",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram("octavo_e2e_request_latency_seconds", "From request arrival to its end",
                                     buckets=E2E_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(snapshot, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
