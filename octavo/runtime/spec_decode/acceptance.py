"""Acceptance-rate estimates: per sequence, shrunk towards the proposer's overall rate.

A proposal's acceptance given that the earlier ones were accepted is modelled as one rate a per
sequence. Each verification with k proposals and m accepted is m successes and, when m < k, one
failure. A sequence's estimate is (successes + W * global) / (trials + W): a new sequence starts at the
global rate and its own history takes over after a few steps. Its history fades a little at every
step it does not verify (text that could not be predicted may be followed by text that can), and
the steps since it last verified are counted (the policy probes after a while). The global rate
forgets old verifications too (recent requests matter most).

Proposals that cost nothing to make (n-gram lookup) need no verification to be judged: a proposal
made at a step where the sequence does not speculate is checked against the tokens the sequence then
emits (ShadowChecks). That is the very outcome verification would have had: a greedy sequence emits
the target's argmax, and a sampled one emits y ~ p, which equals a point-mass proposal x with
probability p(x), the acceptance probability of x.
"""

from __future__ import annotations

from octavo.runtime.sequence import Sequence

PRIOR_WEIGHT = 4.0
GLOBAL_DECAY = 0.995
IDLE_DECAY = 0.9
"""Per step without verification, a sequence's counts shrink by this factor."""

INITIAL_RATE = 0.5


class AcceptanceTracker:
    def __init__(self) -> None:
        self.successes = INITIAL_RATE * PRIOR_WEIGHT
        self.trials = PRIOR_WEIGHT
        self.per_sequence: dict[Sequence, list[float]] = {}
        self.idle_steps: dict[Sequence, int] = {}

    @property
    def global_rate(self) -> float:
        return self.successes / self.trials

    def estimate(self, seq: Sequence) -> float:
        successes, trials = self.per_sequence.get(seq, (0.0, 0.0))
        return (successes + PRIOR_WEIGHT * self.global_rate) / (trials + PRIOR_WEIGHT)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        trials = accepted + (1 if accepted < proposed else 0)
        counts = self.per_sequence.setdefault(seq, [0.0, 0.0])
        counts[0] += accepted
        counts[1] += trials
        self.successes = self.successes * GLOBAL_DECAY ** trials + accepted
        self.trials = self.trials * GLOBAL_DECAY ** trials + trials
        self.idle_steps[seq] = 0

    def idle(self, seq: Sequence) -> None:
        """`seq` could have speculated this step but did not verify anything."""
        counts = self.per_sequence.get(seq)
        if counts is not None:
            counts[0] *= IDLE_DECAY
            counts[1] *= IDLE_DECAY
        self.idle_steps[seq] = self.idle_steps.get(seq, 0) + 1

    def forget(self, seq: Sequence) -> None:
        self.per_sequence.pop(seq, None)
        self.idle_steps.pop(seq, None)

    def forget_all_but(self, running: set[Sequence]) -> None:
        for seq in [seq for seq in self.idle_steps if seq not in running and seq.is_finished]:
            self.forget(seq)


class ShadowChecks:
    """Unverified proposals, scored against the tokens their sequences emit afterwards (one per sequence)."""

    def __init__(self) -> None:
        self.pending: dict[Sequence, tuple[int, list[int]]] = {}

    def watch(self, seq: Sequence, proposal: list[int]) -> None:
        """`proposal` was made for the tokens after seq.token_ids and not verified."""
        if proposal and seq not in self.pending:
            self.pending[seq] = (seq.num_tokens, list(proposal))

    def resolve(self, tracker: AcceptanceTracker) -> None:
        """Record every proposal whose outcome the emitted tokens now decide (a mismatch, or all matched)."""
        for seq, (start, proposal) in list(self.pending.items()):
            if seq.is_finished:
                del self.pending[seq]
                continue
            emitted = seq.token_ids[start:start + len(proposal)]
            matched = 0
            while matched < len(emitted) and emitted[matched] == proposal[matched]:
                matched += 1
            if matched < len(emitted) or matched == len(proposal):
                tracker.record(seq, len(proposal), matched)
                del self.pending[seq]

    def forget(self, seq: Sequence) -> None:
        self.pending.pop(seq, None)
