"""Benchmark result: throughput and latency figures of one run, and how they are printed."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class BenchResult:
    """Figures of one engine on one workload. Latencies are seconds, per request."""

    engine: str
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s else 0.0

    def line(self) -> str:
        """One line with the figures a reader compares."""
        parts = [f"{self.engine:>6} {self.workload}: {self.num_requests} req, {self.prompt_tokens} prompt + "
                 f"{self.output_tokens} output tokens in {self.elapsed_s:.1f}s = "
                 f"{self.output_tokens_per_s:.1f} output tok/s ({self.total_tokens_per_s:.1f} total tok/s)"]
        if self.ttft_s:
            parts.append(f"TTFT mean {_ms(statistics.mean(self.ttft_s))} p50 {_ms(percentile(self.ttft_s, 50))} "
                         f"p99 {_ms(percentile(self.ttft_s, 99))}")
        if self.itl_s:
            parts.append(f"ITL mean {_ms(statistics.mean(self.itl_s))} p50 {_ms(percentile(self.itl_s, 50))} "
                         f"p99 {_ms(percentile(self.itl_s, 99))}")
        parts += [f"{key} {value}" for key, value in self.extra.items()]
        return "; ".join(parts)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}ms"  # two decimals: a one-row step is a few ms
