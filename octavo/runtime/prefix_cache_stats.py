"""Counters that explain what the prefix cache did, including why lookups missed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters (tokens unless the name says otherwise).

    A prompt can only reuse *full* blocks (block_size tokens) and never its
    last token (whose logits must be computed), so for every lookup:
    queried_tokens = hit_tokens + missed_tokens + uncacheable_tokens, where
    uncacheable_tokens are those past the last full block that may be reused
    (a prompt shorter than one block is all uncacheable: a prefix shared by
    two prompts that is shorter than a block cannot hit).
    `lookups_missing_first_block` counts lookups that found nothing at all.
    """

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    missed_tokens: int = 0
    uncacheable_tokens: int = 0
    lookups_missing_first_block: int = 0
    evictions: int = 0
    hash_collisions: int = 0

    def record_lookup(self, num_tokens: int, hit_tokens: int, uncacheable_tokens: int) -> None:
        self.lookups += 1
        self.queried_tokens += num_tokens
        self.hit_tokens += hit_tokens
        self.uncacheable_tokens += uncacheable_tokens
        self.missed_tokens += num_tokens - hit_tokens - uncacheable_tokens
        if hit_tokens == 0 and num_tokens > uncacheable_tokens:
            self.lookups_missing_first_block += 1

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
