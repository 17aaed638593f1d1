"""The step-time cost model recovers a linear cost from noisy timings and follows a change of machine speed."""

from __future__ import annotations

import random

import pytest

from octavo.runtime.spec_decode.cost_model import StepCostModel


def observe_machine(model: StepCostModel, fixed: float, per_token: float, per_multi: float, steps: int,
                    rng: random.Random, noise: float = 0.02) -> None:
    for _ in range(steps):
        tokens, multi = rng.randint(1, 64), rng.randint(0, 8)
        seconds = (fixed + per_token * tokens + per_multi * multi) * (1 + rng.uniform(-noise, noise))
        model.observe(tokens, multi, seconds)


def test_recovers_the_coefficients_of_a_linear_cost():
    model = StepCostModel()
    observe_machine(model, 0.020, 0.0005, 0.002, 300, random.Random(0))
    fixed, per_token, per_multi = model.coefficients
    assert fixed == pytest.approx(0.020, rel=0.1)
    assert per_token == pytest.approx(0.0005, rel=0.1)
    assert per_multi == pytest.approx(0.002, rel=0.1)
    assert model.predict(10, 2) == pytest.approx(0.020 + 0.005 + 0.004, rel=0.05)


def test_follows_a_machine_that_becomes_slower():
    model = StepCostModel()
    rng = random.Random(1)
    observe_machine(model, 0.010, 0.0002, 0.001, 200, rng)
    observe_machine(model, 0.030, 0.0006, 0.003, 200, rng)  # e.g. other work now shares the cores
    assert model.predict(16, 1) == pytest.approx(0.030 + 0.0006 * 16 + 0.003, rel=0.05)


def test_coefficients_are_never_negative_or_free():
    model = StepCostModel()
    model.observe(1, 0, 0.01)
    model.observe(2, 0, 0.005)  # noise: more tokens, less time
    fixed, per_token, per_multi = model.coefficients
    assert fixed >= 0 and per_token > 0 and per_multi >= 0
