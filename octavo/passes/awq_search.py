"""AWQ's searches (Lin et al. 2023) for one group of linears that read the same input: scales, then ranges.

Scale search. With ``m[j] = mean |x_j|`` over the calibration tokens (per input channel),
each ``alpha`` of the grid gives ``s = m ** alpha`` (clamped below at 1e-4), normalized by
``sqrt(max(s) * min(s))``. The weights become ``Q(W diag(s)) diag(s)^-1`` (the input is
divided by s where it is produced: folded into a norm weight or the producing linear's
rows); the loss is the mean squared output error of the group's linears against the float
output over every calibration row, ``sum((E X^T X) * E) / n`` with ``E = Q(W s) / s - W``, summed
over the group's weights (the Gram matrix gives it exactly without keeping the rows). The
alpha with the smallest loss wins (alpha = 0, s = 1, is plain RTN, so the chosen scales never
do worse than RTN on that loss).

Range search (asymmetric clipping). For each row n and group g of a (scaled) weight, the
group's min/max range [lo, hi] loses the fractions (bottom, top) of its width at its ends,
each fraction one of 0, 0.05, ..., 0.25 (36 pairs); values outside the range round to its
ends. The error of that group's part of the output over every calibration token is
``d^T G_g d`` with ``d`` the group's weight error and ``G_g`` the group's diagonal block of
``X^T X``; the range of least error wins, per row and group ((0, 0), no clipping, is a
candidate, so it never does worse than RTN of the same weight on that error). The paper's
search clips symmetrically to ``[-c, c]``; the w4 layout is asymmetric (an offset per group),
so each end is searched on its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.passes.quantize_rtn import (
    DEFAULT_RANGE_CUTS,
    fake_quantize_w4,
    grouped_columns,
    w4_rounded_on_range,
    w4_scale_dtype,
)

DEFAULT_ALPHA_GRID = tuple(index / 20 for index in range(20))
_MIN_SCALE = 1e-4


def scales_for(activation_mean: Tensor, alpha: float) -> Tensor:
    """AWQ's per-channel scales ``m ** alpha``, clamped at 1e-4 and normalized by sqrt(max * min)."""
    scales = activation_mean.pow(alpha).clamp(min=_MIN_SCALE)
    return scales / (scales.max() * scales.min()).sqrt()


def search_scales(weights: list[Tensor], gram: Tensor, activation_mean: Tensor, group_size: int,
                  grid: tuple[float, ...] = DEFAULT_ALPHA_GRID) -> tuple[Tensor, float, list[float]]:
    """(scales [K], the chosen alpha, the loss of every alpha) for `weights` (each [N_i, K]) reading one input.

    `gram` [K, K] is ``X^T X / n`` of that input over the calibration rows, so the loss of
    an alpha, ``sum_i sum((E_i gram) * E_i) / sum_i N_i`` with ``E_i = Q(W_i s) / s - W_i``, is
    the mean squared output error over every calibration row (exactly, not on a sample).
    """
    gram = gram.float()
    losses = []
    best = (float("inf"), 0.0, torch.ones_like(activation_mean))
    for alpha in grid:
        scales = scales_for(activation_mean, alpha)
        loss = sum(output_error(weight, fake_quantize_w4(weight.float() * scales, group_size) / scales, gram)
                   for weight in weights) / sum(weight.shape[0] for weight in weights)
        losses.append(loss)
        if loss < best[0]:
            best = (loss, alpha, scales)
    return best[2], best[1], losses


def output_error(weight: Tensor, approximation: Tensor, gram: Tensor) -> float:
    """``sum((E gram) * E)`` for ``E = approximation - weight``: the squared output error summed over rows."""
    error = approximation.float() - weight.float()
    return float((error @ gram * error).sum())


def gram_blocks(gram: Tensor, group_size: int) -> Tensor:
    """The diagonal blocks [num_groups, gs, gs] of `gram` [K, K]; a short last group's padding is 0."""
    columns = gram.shape[0]
    padded = torch.nn.functional.pad(gram.float(), (0, -columns % group_size, 0, -columns % group_size))
    groups = padded.shape[0] // group_size
    blocks = padded.view(groups, group_size, groups, group_size)
    return blocks[torch.arange(groups), :, torch.arange(groups), :]


def search_range(weight: Tensor, blocks: Tensor, group_size: int,
                 cuts: tuple[tuple[float, float], ...] = DEFAULT_RANGE_CUTS) -> tuple[Tensor, Tensor]:
    """Per row and group, the range (low, high) [N, num_groups] of least output error ``d^T G_g d``.

    Each candidate cuts the fractions (bottom, top) of the group's min/max range [lo, hi] from
    its ends: ``low = lo + bottom (hi - lo)``, ``high = hi - top (hi - lo)``; d is the group's
    error when it is rounded to w4 on that range (values outside it take the nearest end).
    The first candidate of least error wins; quantize_rtn.grid_cuts puts (0, 0), RTN's own range, first.
    `blocks` is gram_blocks' [num_groups, gs, gs] of this weight's input (scaled like the weight's
    columns); their zero padding leaves a short last group's padded columns out of its error.
    """
    grouped = grouped_columns(weight.float(), group_size)
    scale_dtype = w4_scale_dtype(weight)
    lowest, highest = grouped.amin(-1), grouped.amax(-1)
    width = highest - lowest
    best_error = torch.full_like(lowest, float("inf"))
    best_low, best_high = lowest.clone(), highest.clone()
    for bottom, top in cuts:
        low, high = lowest + bottom * width, highest - top * width
        error = w4_rounded_on_range(grouped, low, high, scale_dtype) - grouped
        group_error = torch.einsum("ngi,gij,ngj->ng", error, blocks, error)
        better = group_error < best_error
        best_error = torch.where(better, group_error, best_error)
        best_low, best_high = torch.where(better, low, best_low), torch.where(better, high, best_high)
    return best_low, best_high


def clamp_groups(weight: Tensor, low: Tensor, high: Tensor, group_size: int) -> Tensor:
    """`weight` [N, K] clamped to [low, high] per row and group (each [N, num_groups])."""
    columns = weight.shape[1]
    low = low.repeat_interleave(group_size, dim=1)[:, :columns]
    high = high.repeat_interleave(group_size, dim=1)[:, :columns]
    return torch.minimum(torch.maximum(weight.float(), low), high)
