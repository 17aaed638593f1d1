"""Step-time cost model, fitted online: seconds = a + b * tokens + c * multi + d * [tokens > 1].

`tokens` is the step's query token count and `multi` the number of sequences with more than one
query token (prefill chunks, speculative verification), which the attention kernels treat one at a
time. The last term is a jump between a one-token step and any larger one: a matrix-vector product
reads the weights at memory speed, while a matrix product of a few rows can cost noticeably more
(CPU GEMM kernels pack their operands), so verifying proposals at batch 1 is not as free as the
weight traffic alone suggests. The coefficients solve an exponentially weighted least-squares
problem over the steps the engine actually ran (recent steps weigh most), regularized by a prior:
timings of a few step shapes measured when the engine starts, which keep every coefficient
identifiable while the real steps all look alike. So the model follows the machine the engine runs
on, its thread count and its load, instead of constants tuned on one machine.
"""

from __future__ import annotations

NUM_FEATURES = 4
FORGETTING = 0.98
"""Weight of an observation after each newer one: about the last 50 steps dominate."""

PRIOR_WEIGHT = 2.0
"""Weight of each start-up measurement, which is never forgotten (as much as 2 recent steps)."""

RIDGE = 1e-9
"""Keeps the normal equations solvable before any observation (seconds^2 scale)."""

MIN_TOKEN_SECONDS = 1e-7
"""A floor for the marginal cost of a token, so that a noisy fit never makes tokens free."""


class StepCostModel:
    """seconds(tokens, multi) = a + b * tokens + c * multi + d * [tokens > 1], with a, c, d >= 0 and
    b >= MIN_TOKEN_SECONDS."""

    def __init__(self) -> None:
        size = NUM_FEATURES
        self._prior_gram = [[RIDGE if i == j else 0.0 for j in range(size)] for i in range(size)]
        self._prior_moment = [0.0] * size
        self._gram = [[0.0] * size for _ in range(size)]
        self._moment = [0.0] * size
        self._coefficients: tuple[float, ...] | None = (0.0, MIN_TOKEN_SECONDS, 0.0, 0.0)
        self.num_observations = 0

    def calibrate(self, tokens: int, multi: int, seconds: float) -> None:
        """A start-up measurement: part of the prior, never forgotten."""
        _accumulate(self._prior_gram, self._prior_moment, _features(tokens, multi), seconds, PRIOR_WEIGHT)
        self._coefficients = None

    def observe(self, tokens: int, multi: int, seconds: float) -> None:
        """The measured time of one step; older observations fade by FORGETTING per new one."""
        for row in self._gram:
            for j in range(NUM_FEATURES):
                row[j] *= FORGETTING
        self._moment = [value * FORGETTING for value in self._moment]
        _accumulate(self._gram, self._moment, _features(tokens, multi), seconds, 1.0)
        self.num_observations += 1
        self._coefficients = None

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(a, b, c, d) in seconds."""
        if self._coefficients is None:
            gram = [[p + g for p, g in zip(prior, row, strict=True)]
                    for prior, row in zip(self._prior_gram, self._gram, strict=True)]
            moment = [p + m for p, m in zip(self._prior_moment, self._moment, strict=True)]
            a, b, c, d = _solve(gram, moment)
            self._coefficients = (max(a, 0.0), max(b, MIN_TOKEN_SECONDS), max(c, 0.0), max(d, 0.0))
        return self._coefficients

    def predict(self, tokens: int, multi: int) -> float:
        return sum(w * x for w, x in zip(self.coefficients, _features(tokens, multi), strict=True))


def _features(tokens: int, multi: int) -> tuple[float, ...]:
    return (1.0, float(tokens), float(multi), 1.0 if tokens > 1 else 0.0)


def _accumulate(gram: list[list[float]], moment: list[float], x: tuple[float, ...], y: float, weight: float) -> None:
    for i in range(NUM_FEATURES):
        moment[i] += weight * x[i] * y
        for j in range(NUM_FEATURES):
            gram[i][j] += weight * x[i] * x[j]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (4 x 4: plain floats beat a tensor call)."""
    size = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(size)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(rows[r][column]))
        rows[column], rows[pivot] = rows[pivot], rows[column]
        if rows[column][column] == 0.0:
            continue
        for r in range(column + 1, size):
            factor = rows[r][column] / rows[column][column]
            for j in range(column, size + 1):
                rows[r][j] -= factor * rows[column][j]
    solution = [0.0] * size
    for r in range(size - 1, -1, -1):
        if rows[r][r] != 0.0:
            solution[r] = (rows[r][size] - sum(rows[r][j] * solution[j] for j in range(r + 1, size))) / rows[r][r]
    return solution
