"""The step-time cost model recovers its coefficients from noisy timings and follows a change of machine speed."""

from __future__ import annotations

import random

import pytest

from octavo.runtime.spec_decode.cost_model import StepCostModel


def machine(fixed: float, per_token: float, per_multi: float, jump: float):
    """Step seconds of a machine with these costs."""
    return lambda tokens, multi: fixed + per_token * tokens + per_multi * multi + (jump if tokens > 1 else 0.0)


def observe_machine(model: StepCostModel, seconds, steps: int, rng: random.Random, noise: float = 0.02) -> None:
    for _ in range(steps):
        tokens = rng.choice([1, 1, rng.randint(2, 64)])
        multi = rng.randint(0, min(8, tokens // 2))
        model.observe(tokens, multi, seconds(tokens, multi) * (1 + rng.uniform(-noise, noise)))


def test_recovers_the_coefficients():
    model = StepCostModel()
    observe_machine(model, machine(0.020, 0.0005, 0.002, 0.006), 400, random.Random(0))
    fixed, per_token, per_multi, jump = model.coefficients
    assert fixed == pytest.approx(0.020, rel=0.1)
    assert per_token == pytest.approx(0.0005, rel=0.1)
    assert per_multi == pytest.approx(0.002, rel=0.15)
    assert jump == pytest.approx(0.006, rel=0.15)
    assert model.predict(10, 2) == pytest.approx(0.020 + 0.005 + 0.004 + 0.006, rel=0.05)
    assert model.predict(1, 0) == pytest.approx(0.0205, rel=0.05)


def test_follows_a_machine_that_becomes_slower():
    model = StepCostModel()
    rng = random.Random(1)
    observe_machine(model, machine(0.010, 0.0002, 0.001, 0.002), 200, rng)
    slower = machine(0.030, 0.0006, 0.003, 0.006)  # e.g. other work now shares the cores
    observe_machine(model, slower, 200, rng)
    assert model.predict(16, 1) == pytest.approx(slower(16, 1), rel=0.05)


def test_coefficients_are_never_negative_or_free():
    model = StepCostModel()
    model.observe(1, 0, 0.01)
    model.observe(2, 0, 0.005)  # noise: more tokens, less time
    fixed, per_token, per_multi, jump = model.coefficients
    assert fixed >= 0 and per_token > 0 and per_multi >= 0 and jump >= 0
