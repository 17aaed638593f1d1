"""How many tokens to propose for each sequence this step: the plan that maximizes expected tokens per second.

Each speculating sequence i has an estimated acceptance rate a_i (the chance that a proposal is
accepted given that the ones before it were). With k_i proposals its expected emitted tokens are
1 + a_i + ... + a_i^k_i. The step's cost comes from the measured cost models (target step, and draft
model steps for a draft proposer). Proposals are worth their verification only when their expected
tokens exceed what the same time buys without them: sequence i proposes the k_i that maximizes
(a_i + ... + a_i^k_i) - (the seconds they add) x (tokens per second of the step without
speculation), where the first proposal pays for turning the sequence into a multi-token one and
the next ones for one more token each (judged together: a first proposal that does not pay alone may
pay with the ones after it). Among the maximum depths K = 0..k the one with the highest expected
tokens per second wins. At batch 1 on a
CPU a step costs about the same for 1 or k + 1 tokens (the weights are read once), so speculation
pays even for modest acceptance rates; in a large batch the step is compute bound, the threshold
rises above every a_i, and speculation turns off.

Text that could not be predicted may be followed by text that can (a model that starts repeating
itself, a quotation), so a sequence that is not speculating must still be judged: free proposals are
checked against the tokens emitted anyway (see acceptance.ShadowChecks); a draft model's are
verified now and then (a probe), spaced so that probes cost at most PROBE_BUDGET of the time, by
the same cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

from octavo.runtime.spec_decode.cost_model import StepCostModel

PROBE_BUDGET = 0.02
"""Share of the step time that probes (verifications the estimates advise against) may cost."""


@dataclass
class Candidate:
    """A sequence that may speculate: its acceptance estimate and how many tokens it may propose."""

    acceptance: float
    max_tokens: int


@dataclass
class StepShape:
    """The rest of the step, as the scheduler will run it: query tokens, multi-token sequences and
    tokens it emits (decodes and prefills that finish their prompt)."""

    tokens: int
    multi: int
    emitted: int


class SpeculationPolicy:
    """Chooses the number of proposals per candidate (see the module docstring)."""

    def __init__(self, max_tokens: int, adaptive: bool, target_cost: StepCostModel,
                 draft_cost: StepCostModel | None = None):
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.target_cost = target_cost
        self.draft_cost = draft_cost

    def plan(self, candidates: list[Candidate], rest: StepShape) -> list[int]:
        if not self.adaptive:
            return [min(self.max_tokens, candidate.max_tokens) for candidate in candidates]
        base_tokens = rest.tokens + len(candidates)
        base_cost = self.target_cost.predict(base_tokens, rest.multi)
        base_rate = (rest.emitted + len(candidates)) / base_cost
        # A sequence's first proposal makes it a multi-token sequence; the next ones add a token each.
        first_cost = self.target_cost.predict(base_tokens + 1, rest.multi + 1) - base_cost
        next_cost = self.target_cost.coefficients[1]
        caps = [self._worth(candidate, base_rate, first_cost, next_cost) for candidate in candidates]
        best_depth, best_rate = 0, base_rate
        for depth in range(1, max(caps, default=0) + 1):
            rate = self._rate([min(depth, cap) for cap in caps], candidates, rest)
            if rate > best_rate:
                best_depth, best_rate = depth, rate
        return [min(best_depth, cap) for cap in caps]

    def _worth(self, candidate: Candidate, base_rate: float, first_cost: float, next_cost: float) -> int:
        """The number of proposals of this sequence with the largest expected gain in tokens (0: none pays)."""
        best_count, best_gain = 0, 0.0
        expected = power = 1.0
        for count in range(1, min(self.max_tokens, candidate.max_tokens) + 1):
            power *= candidate.acceptance
            expected += power
            gain = (expected - 1.0) - (first_cost + (count - 1) * next_cost) * base_rate
            if gain > best_gain:
                best_count, best_gain = count, gain
        return best_count

    def probe_interval(self, num_tokens: int, step: StepShape) -> float:
        """Steps between two probes of `num_tokens` proposals of one sequence, in a step shaped like `step`,
        so that probing costs PROBE_BUDGET of the time."""
        cost = self.target_cost.predict(step.tokens, step.multi)
        extra = self.target_cost.predict(step.tokens + num_tokens, step.multi + 1) - cost
        if self.draft_cost is not None:
            extra += num_tokens * self.draft_cost.predict(1, 0)
        return extra / (PROBE_BUDGET * cost)

    def _rate(self, counts: list[int], candidates: list[Candidate], rest: StepShape) -> float:
        emitted = rest.emitted + sum(expected_tokens(c.acceptance, k) for c, k in zip(candidates, counts, strict=True))
        speculating = sum(1 for k in counts if k)
        seconds = self.target_cost.predict(rest.tokens + len(candidates) + sum(counts), rest.multi + speculating)
        if self.draft_cost is not None and speculating:
            # One draft step per proposed position, each over the speculating sequences.
            seconds += max(counts) * self.draft_cost.predict(speculating, 0)
        return emitted / seconds


def expected_tokens(acceptance: float, num_proposals: int) -> float:
    """1 + a + ... + a^k: expected tokens emitted by one sequence verifying k proposals."""
    return sum(acceptance ** j for j in range(num_proposals + 1))
