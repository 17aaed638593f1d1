"""AWQ's searches (Lin et al. 2023) for one group of linears that read the same input: scales, then clipping.

Scale search. With ``m[j] = mean |x_j|`` over the calibration tokens (per input channel),
each ``alpha`` of the grid gives ``s = m ** alpha`` (clamped below at 1e-4), normalized by
``sqrt(max(s) * min(s))``. The weights become ``Q(W diag(s)) diag(s)^-1`` (the input is
divided by s where it is produced: folded into a norm weight or the producing linear's
rows); the loss is the mean squared output error of the group's linears against the float
output on sampled calibration inputs X [n, K]: ``mean((X (Q(W s) / s - W)^T)^2)`` summed over the
group's weights. The alpha with the smallest loss wins (alpha = 0, s = 1, is plain RTN, so
the chosen scales never do worse than RTN on that loss). ``tie`` maps channels that must
share one scale (an o_proj input whose channels come from one value channel under GQA) to
a class: m is averaged over each class first.

Clipping search. For each row n and group g of a (scaled) weight, the range is clamped to
``[-c, c]`` with ``c = max|w| * (1 - i / 20)`` for i in 0..9 before RTN; the error of that
group's part of the output over every calibration token is ``d^T G_g d`` with ``d`` the
group's weight error and ``G_g`` the group's block of ``X^T X`` (GramBlocks); the c with the
smallest error wins, per row and group (i = 0 is no clipping).
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.ir.quantized_layout import num_groups
from octavo.passes.quantize_rtn import fake_quantize_w4

DEFAULT_ALPHA_GRID = tuple(index / 20 for index in range(20))
CLIP_STEPS = 20
CLIP_MAX_SHRINK = 0.5
_MIN_SCALE = 1e-4


def mean_abs(inputs: Tensor) -> Tensor:
    """Per-channel mean |x| over every row of inputs [..., K], float32 [K]."""
    return inputs.reshape(-1, inputs.shape[-1]).float().abs().mean(0)


def tied_mean(values: Tensor, tie: Tensor | None) -> Tensor:
    """`values` [K] averaged over the channels of each class of `tie` [K] (class ids), gathered back to [K]."""
    if tie is None:
        return values
    classes = int(tie.max()) + 1
    sums = torch.zeros(classes, dtype=values.dtype).index_add_(0, tie, values)
    counts = torch.zeros(classes, dtype=values.dtype).index_add_(0, tie, torch.ones_like(values))
    return (sums / counts)[tie]


def scales_for(activation_mean: Tensor, alpha: float) -> Tensor:
    """AWQ's per-channel scales ``m ** alpha``, clamped at 1e-4 and normalized by sqrt(max * min)."""
    scales = activation_mean.pow(alpha).clamp(min=_MIN_SCALE)
    return scales / (scales.max() * scales.min()).sqrt()


def search_scales(weights: list[Tensor], sample: Tensor, activation_mean: Tensor, group_size: int,
                  grid: tuple[float, ...] = DEFAULT_ALPHA_GRID) -> tuple[Tensor, float, list[float]]:
    """(scales [K], the chosen alpha, the loss of every alpha) for `weights` (each [N_i, K]) on `sample` [n, K]."""
    sample = sample.float()
    losses = []
    best = (float("inf"), 0.0, torch.ones_like(activation_mean))
    for alpha in grid:
        scales = scales_for(activation_mean, alpha)
        loss = 0.0
        for weight in weights:
            weight = weight.float()
            error = fake_quantize_w4(weight * scales, group_size) / scales - weight
            loss += float(torch.mm(sample, error.T).pow(2).mean()) * weight.shape[0]
        loss /= sum(weight.shape[0] for weight in weights)
        losses.append(loss)
        if loss < best[0]:
            best = (loss, alpha, scales)
    return best[2], best[1], losses


class GramBlocks:
    """The diagonal blocks ``X_g^T X_g`` [num_groups, group_size, group_size] of the inputs' Gram matrix, float32.

    A short last group is zero-padded (its padding rows and columns stay 0).
    """

    def __init__(self, in_features: int, group_size: int):
        self.in_features, self.group_size = in_features, group_size
        self.blocks = torch.zeros(num_groups(in_features, group_size), group_size, group_size)
        self.rows = 0

    def add(self, inputs: Tensor) -> None:
        rows = _padded(inputs.reshape(-1, self.in_features).float(), self.group_size)
        grouped = rows.view(rows.shape[0], -1, self.group_size).transpose(0, 1)  # [G, n, gs]
        self.blocks.baddbmm_(grouped.transpose(1, 2), grouped)
        self.rows += rows.shape[0]

    def scaled(self, scales: Tensor) -> Tensor:
        """The blocks of the Gram of ``X / scales`` (the input after scales are folded upstream)."""
        inverse = _padded(1.0 / scales.float().unsqueeze(0), self.group_size).view(-1, self.group_size)
        return self.blocks * inverse.unsqueeze(2) * inverse.unsqueeze(1)


def search_clip(weight: Tensor, blocks: Tensor, group_size: int) -> Tensor:
    """Per row and group, the clipping bound c [N, num_groups] that minimizes the group's output error (see above).

    `blocks` is GramBlocks' [num_groups, gs, gs] for this weight's input (scaled like the weight's columns).
    """
    weight = weight.float()
    rows, columns = weight.shape
    original_max = _grouped_abs_max(weight, group_size)
    best_error = torch.full_like(original_max, float("inf"))
    best_bound = original_max.clone()
    for step in range(int(CLIP_MAX_SHRINK * CLIP_STEPS)):
        bound = original_max * (1 - step / CLIP_STEPS)
        clipped = clip_groups(weight, bound, group_size)
        error = _padded(fake_quantize_w4(clipped, group_size) - weight, group_size).view(rows, -1, group_size)
        group_error = torch.einsum("ngi,gij,ngj->ng", error, blocks, error)
        better = group_error < best_error
        best_error = torch.where(better, group_error, best_error)
        best_bound = torch.where(better, bound, best_bound)
    return best_bound


def clip_groups(weight: Tensor, bound: Tensor, group_size: int) -> Tensor:
    """`weight` [N, K] clamped to [-bound, bound] per row and group (bound [N, num_groups])."""
    expanded = bound.repeat_interleave(group_size, dim=1)[:, :weight.shape[1]]
    return torch.maximum(torch.minimum(weight.float(), expanded), -expanded)


def _grouped_abs_max(weight: Tensor, group_size: int) -> Tensor:
    return _padded(weight.abs(), group_size).view(weight.shape[0], -1, group_size).amax(-1)


def _padded(values: Tensor, group_size: int) -> Tensor:
    """[n, K] -> [n, num_groups * group_size], the extra columns zero."""
    missing = -values.shape[1] % group_size
    return torch.nn.functional.pad(values, (0, missing)) if missing else values
