"""Speculative decoding counters, and the snapshot the engine reports (acceptance and speed apart)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    """Cumulative figures since the engine started.

    - ``proposer``: "ngram" or "draft"; ``max_proposed``: k.
    - ``num_verify_steps``: target steps that verified at least one proposal;
      ``num_verifications``: (sequence, step) pairs that verified proposals.
    - ``proposed_tokens`` / ``accepted_tokens``: proposals verified / accepted;
      ``emitted_tokens``: tokens those verifications added (accepted ones plus the target's own).
    - ``proposed_per_position[j]`` / ``accepted_per_position[j]``: the same for the (j+1)-th proposal
      of a step, so ``acceptance_per_position[j]`` is the rate at that depth.
    - ``speculative_seconds``: wall time of the engine steps (proposing included) while speculation was
      on; ``estimated_plain_seconds``: what the same emitted tokens would have cost without it, from
      the measured cost model of plain steps. ``speedup`` is their ratio: > 1 means faster.
    """

    proposer: str
    max_proposed: int
    num_verify_steps: int = 0
    num_verifications: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    speculative_seconds: float = 0.0
    estimated_plain_seconds: float = 0.0
    draft_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [accepted / proposed if proposed else 0.0
                for accepted, proposed in zip(self.accepted_per_position, self.proposed_per_position, strict=True)]

    @property
    def mean_accepted_length(self) -> float:
        """Accepted proposals per verification."""
        return self.accepted_tokens / self.num_verifications if self.num_verifications else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verifying sequence gains per target step (1 without speculation)."""
        return self.emitted_tokens / self.num_verifications if self.num_verifications else 0.0

    @property
    def speedup(self) -> float:
        """Estimated plain time / measured time of the same tokens (1.0 before any measurement)."""
        return self.estimated_plain_seconds / self.speculative_seconds if self.speculative_seconds else 1.0

    def since(self, earlier: SpecDecodeMetrics) -> SpecDecodeMetrics:
        """The counts accumulated after the snapshot `earlier` (e.g. a benchmark without its warm-up)."""
        def minus(now: list[int], before: list[int]) -> list[int]:
            return [value - (before[index] if index < len(before) else 0) for index, value in enumerate(now)]

        counts = {name: getattr(self, name) - getattr(earlier, name) for name in (
            "num_verify_steps", "num_verifications", "proposed_tokens", "accepted_tokens", "emitted_tokens",
            "speculative_seconds", "estimated_plain_seconds", "draft_seconds")}
        return SpecDecodeMetrics(self.proposer, self.max_proposed, **counts,
                                 proposed_per_position=minus(self.proposed_per_position, earlier.proposed_per_position),
                                 accepted_per_position=minus(self.accepted_per_position, earlier.accepted_per_position))

    def record(self, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        """One sequence's verification in one step."""
        while len(self.proposed_per_position) < num_proposed:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        for position in range(num_proposed):
            self.proposed_per_position[position] += 1
            self.accepted_per_position[position] += position < num_accepted
        self.num_verifications += 1
        self.proposed_tokens += num_proposed
        self.accepted_tokens += num_accepted
        self.emitted_tokens += num_emitted

    def summary(self) -> str:
        """One line for logs and `octavo bench`."""
        positions = " ".join(f"{rate:.2f}" for rate in self.acceptance_per_position)
        return (f"speculative {self.proposer}:{self.max_proposed}: acceptance {self.acceptance_rate:.1%} "
                f"(per position {positions or '-'}), {self.mean_accepted_length:.2f} accepted and "
                f"{self.tokens_per_step:.2f} tokens per verifying step, {self.proposed_tokens} proposed, "
                f"estimated speedup {self.speedup:.2f}x")
