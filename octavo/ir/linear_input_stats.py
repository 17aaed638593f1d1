"""Statistics of the inputs a linear sees on calibration text: what AWQ and GPTQ need of the activations.

For the rows x (each [K], one token) that reach a linear's input over the calibration text:

- ``gram`` [K, K] float32: ``sum x^T x`` (GPTQ's Hessian is ``2 gram / rows``; AWQ's layer
  output error of a weight error E [N, K] over every token is ``sum((E gram) * E)``);
- ``abs_sum`` [K] float32: ``sum |x|`` per channel (AWQ's activation magnitude is ``abs_sum / rows``);
- ``rows``: how many rows were added.

The frontend's calibration runner fills them (one per linear input, shared by the linears
that read it); quantization schemes read them. This module only manipulates tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class LinearInputStats:
    """Running sums over the rows of one linear input (see the module docstring)."""

    in_features: int
    gram: Tensor = field(init=False)
    abs_sum: Tensor = field(init=False)
    rows: int = 0

    def __post_init__(self) -> None:
        self.gram = torch.zeros(self.in_features, self.in_features, dtype=torch.float32)
        self.abs_sum = torch.zeros(self.in_features, dtype=torch.float32)

    def add(self, inputs: Tensor) -> None:
        """Add every row of `inputs` [..., K]."""
        rows = inputs.detach().reshape(-1, self.in_features).float()
        self.gram.addmm_(rows.T, rows)
        self.abs_sum += rows.abs().sum(0)
        self.rows += rows.shape[0]

    @property
    def abs_mean(self) -> Tensor:
        """mean |x| per channel, [K]."""
        return self.abs_sum / max(self.rows, 1)

    def hessian(self) -> Tensor:
        """GPTQ's ``H = 2 X^T X / rows`` [K, K]."""
        return self.gram * (2.0 / max(self.rows, 1))
