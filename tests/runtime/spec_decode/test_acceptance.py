"""Acceptance estimates: shrinkage towards the overall rate, and unverified proposals judged by the emitted tokens."""

from __future__ import annotations

import pytest

from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.sequence import Sequence
from octavo.runtime.spec_decode.acceptance import PRIOR_WEIGHT, AcceptanceTracker, ShadowChecks


def sequence(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), detokenizer=None)


def test_a_sequence_estimate_moves_from_the_overall_rate_to_its_own():
    tracker = AcceptanceTracker()
    good, fresh = sequence([1, 2]), sequence([3, 4])
    start = tracker.estimate(fresh)
    for _ in range(30):
        tracker.record(good, proposed=4, accepted=4)
    assert tracker.estimate(good) > 0.95  # 120 successes, no failure
    assert start < tracker.estimate(fresh) < tracker.estimate(good)  # the overall rate rose too
    bad = sequence([5])
    tracker.record(bad, proposed=4, accepted=0)
    # One failure and the prior: (0 + W * overall) / (1 + W).
    assert tracker.estimate(bad) == pytest.approx(PRIOR_WEIGHT * tracker.global_rate / (1 + PRIOR_WEIGHT))


def test_shadow_proposals_are_scored_by_the_tokens_emitted_next():
    tracker, shadow = AcceptanceTracker(), ShadowChecks()
    seq = sequence([10, 11, 12])
    shadow.watch(seq, [13, 14, 15])
    shadow.resolve(tracker)
    assert seq in shadow.pending  # nothing emitted yet: undecided
    seq.append_token(13)
    shadow.resolve(tracker)
    assert seq in shadow.pending  # one match so far
    seq.append_token(99)
    shadow.resolve(tracker)
    assert seq not in shadow.pending
    assert tracker.per_sequence[seq] == [1.0, 2.0]  # one accepted, then a rejection: 1 success in 2 trials
    shadow.watch(seq, [7, 8])
    seq.append_token(7)
    seq.append_token(8)
    shadow.resolve(tracker)
    assert tracker.per_sequence[seq] == [3.0, 4.0]  # both would have been accepted
