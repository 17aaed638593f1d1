"""The speculation policy: proposals where verifying them is nearly free, none where the step is compute bound."""

from __future__ import annotations

import pytest

from octavo.runtime.spec_decode.cost_model import StepCostModel
from octavo.runtime.spec_decode.policy import (
    PROBE_BUDGET,
    Candidate,
    SpeculationPolicy,
    StepShape,
    expected_tokens,
)


def cost_model(fixed: float, per_token: float, per_multi: float) -> StepCostModel:
    """A model fitted on exact timings of a machine with these costs."""
    model = StepCostModel()
    for tokens in range(1, 80, 3):
        for multi in range(0, 9, 2):
            model.observe(tokens, multi, fixed + per_token * tokens + per_multi * multi)
    return model


MEMORY_BOUND = (0.020, 0.0002, 0.0005)   # a decode step reads the weights once: tokens are cheap
COMPUTE_BOUND = (0.001, 0.002, 0.0005)   # every token costs as much as the fixed part


def plan(costs, acceptance: float, batch: int, max_tokens: int = 4) -> list[int]:
    policy = SpeculationPolicy(max_tokens, adaptive=True, target_cost=cost_model(*costs))
    return policy.plan([Candidate(acceptance, max_tokens)] * batch, StepShape(0, 0, 0))


def test_batch_one_on_a_memory_bound_step_proposes_the_maximum():
    assert plan(MEMORY_BOUND, 0.6, batch=1) == [4]


def test_low_acceptance_or_compute_bound_steps_do_not_speculate():
    assert plan(MEMORY_BOUND, 0.005, batch=1) == [0]
    assert plan(COMPUTE_BOUND, 0.6, batch=8) == [0] * 8


def test_fewer_proposals_as_the_batch_grows():
    depths = [plan(MEMORY_BOUND, 0.7, batch)[0] for batch in (1, 8, 32, 64, 128)]
    assert depths == sorted(depths, reverse=True)
    assert depths[0] == 4 and depths[-1] == 0


def test_the_plan_maximizes_expected_tokens_per_second():
    costs = cost_model(*MEMORY_BOUND)
    policy = SpeculationPolicy(4, adaptive=True, target_cost=costs)
    candidates = [Candidate(0.8, 4), Candidate(0.3, 4), Candidate(0.8, 1)]
    counts = policy.plan(candidates, StepShape(0, 0, 0))

    def rate(ks):
        tokens = sum(expected_tokens(c.acceptance, k) for c, k in zip(candidates, ks, strict=True))
        return tokens / costs.predict(3 + sum(ks), sum(1 for k in ks if k))

    every_plan = [(a, b, c) for a in range(5) for b in range(5) for c in range(2)]
    assert rate(counts) == pytest.approx(max(rate(ks) for ks in every_plan), rel=0.02)
    assert counts[2] <= 1  # never more than a sequence may propose


def test_fixed_policy_proposes_k_capped_by_what_the_sequence_allows():
    policy = SpeculationPolicy(3, adaptive=False, target_cost=StepCostModel())
    assert policy.plan([Candidate(0.0, 5), Candidate(0.9, 2)], StepShape(0, 0, 0)) == [3, 2]


def test_draft_model_cost_limits_the_depth():
    target = cost_model(*MEMORY_BOUND)
    cheap_draft, dear_draft = cost_model(0.001, 0.0001, 0.0), cost_model(0.030, 0.0005, 0.0)
    candidates = [Candidate(0.7, 4)]
    cheap = SpeculationPolicy(4, True, target, cheap_draft).plan(candidates, StepShape(0, 0, 0))
    dear = SpeculationPolicy(4, True, target, dear_draft).plan(candidates, StepShape(0, 0, 0))
    assert cheap == [4] and dear == [0]


def test_probes_cost_the_budgeted_share_of_the_time():
    costs = cost_model(*MEMORY_BOUND)
    policy = SpeculationPolicy(4, adaptive=True, target_cost=costs)
    step = StepShape(1, 0, 1)
    interval = policy.probe_interval(4, step)
    extra = costs.predict(5, 1) - costs.predict(1, 0)
    # One probe every `interval` steps adds `extra` seconds: that share of the time the steps take.
    assert extra / (interval * costs.predict(1, 0)) == pytest.approx(PROBE_BUDGET)
    assert plan(MEMORY_BOUND, 0.0, batch=1) == [0]  # the plan itself never probes


def test_proposals_are_judged_together():
    """A first proposal that does not pay for turning the step multi-token alone pays with the next ones."""
    jumpy = StepCostModel()
    for tokens in (1, 2, 3, 5, 8, 12):
        for multi in (0, 1, 2):
            jumpy.observe(tokens, multi, 0.100 + 0.005 * tokens + 0.020 * multi + (0.030 if tokens > 1 else 0.0))
    policy = SpeculationPolicy(4, adaptive=True, target_cost=jumpy)
    # One proposal at a = 0.5: 0.5 tokens for 0.055 s at 1/0.105 tokens/s (0.52 tokens): not worth it;
    # four: 0.94 tokens for 0.07 s (0.67 tokens): worth it.
    assert policy.plan([Candidate(0.5, 1)], StepShape(0, 0, 0)) == [0]
    assert policy.plan([Candidate(0.5, 4)], StepShape(0, 0, 0)) == [4]
