"""Step-time cost model, fitted online: seconds = a + b * tokens + c * multi-token sequences.

`tokens` is the step's query token count and `multi-token sequences` the number of sequences with more
than one query token (prefill chunks, speculative verification), which the attention kernels treat
one at a time. The coefficients are fitted by exponentially weighted recursive least squares on the
steps the engine actually runs (and on calibration runs at start), so they follow the machine the
engine runs on, its thread count and its load, instead of constants tuned on one machine.
"""

from __future__ import annotations

import torch

NUM_FEATURES = 3
FORGETTING = 0.98
"""Weight of an observation after each newer one: about the last 50 steps dominate."""

PRIOR_VARIANCE = 1.0
MIN_TOKEN_SECONDS = 1e-7
"""A floor for the marginal cost of a token, so that a noisy fit never makes tokens free."""


class StepCostModel:
    """seconds(tokens, multi) = a + b * tokens + c * multi, with a, c >= 0 and b >= MIN_TOKEN_SECONDS."""

    def __init__(self) -> None:
        self.weights = torch.zeros(NUM_FEATURES, dtype=torch.float64)
        self.covariance = torch.eye(NUM_FEATURES, dtype=torch.float64) * PRIOR_VARIANCE
        self.num_observations = 0

    def observe(self, tokens: int, multi: int, seconds: float) -> None:
        """One recursive least-squares update with forgetting."""
        x = torch.tensor([1.0, float(tokens), float(multi)], dtype=torch.float64)
        px = self.covariance @ x
        gain = px / (FORGETTING + x @ px)
        self.weights += gain * (seconds - float(x @ self.weights))
        self.covariance = (self.covariance - torch.outer(gain, px)) / FORGETTING
        self.num_observations += 1

    @property
    def coefficients(self) -> tuple[float, float, float]:
        a, b, c = self.weights.tolist()
        return max(a, 0.0), max(b, MIN_TOKEN_SECONDS), max(c, 0.0)

    def predict(self, tokens: int, multi: int) -> float:
        a, b, c = self.coefficients
        return a + b * tokens + c * multi
