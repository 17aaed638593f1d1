"""Pearson's chi-square goodness-of-fit test, with the p-value from the regularized incomplete gamma function."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0
"""Cells expected fewer times are pooled into one (the chi-square approximation needs about 5 per cell)."""

SIGNIFICANCE = 1e-3
"""Fixed seeds make every run the same; a correct sampler fails this at most once in 1000 seed choices."""


@dataclass
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    samples: int

    def __str__(self) -> str:
        return f"chi-square {self.statistic:.2f}, dof {self.dof}, p-value {self.p_value:.3f}, {self.samples} samples"


def chi_square(counts: dict, probabilities: dict) -> ChiSquare:
    """Test observed `counts` (outcome -> count) against `probabilities` (outcome -> probability).

    An outcome observed but given probability 0 fails at once (p-value 0).
    """
    total = sum(counts.values())
    if any(count and probabilities.get(outcome, 0.0) == 0.0 for outcome, count in counts.items()):
        return ChiSquare(float("inf"), 0, 0.0, total)
    cells = []
    pooled_count = pooled_expected = 0.0
    for outcome, probability in probabilities.items():
        expected = probability * total
        if expected >= MIN_EXPECTED:
            cells.append((counts.get(outcome, 0), expected))
        else:
            pooled_count += counts.get(outcome, 0)
            pooled_expected += expected
    if pooled_expected >= MIN_EXPECTED:
        cells.append((pooled_count, pooled_expected))
    elif cells:  # too little to stand alone: merge into the smallest cell
        smallest = min(range(len(cells)), key=lambda i: cells[i][1])
        cells[smallest] = (cells[smallest][0] + pooled_count, cells[smallest][1] + pooled_expected)
    statistic = sum((count - expected) ** 2 / expected for count, expected in cells)
    dof = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64))) if dof else 1.0
    return ChiSquare(statistic, dof, p_value, total)
