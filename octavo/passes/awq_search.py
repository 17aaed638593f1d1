"""AWQ's searches (Lin et al. 2023) for one group of linears that read the same input: scales, then clipping.

Scale search. With ``m[j] = mean |x_j|`` over the calibration tokens (per input channel),
each ``alpha`` of the grid gives ``s = m ** alpha`` (clamped below at 1e-4), normalized by
``sqrt(max(s) * min(s))``. The weights become ``Q(W diag(s)) diag(s)^-1`` (the input is
divided by s where it is produced: folded into a norm weight or the producing linear's
rows); the loss is the mean squared output error of the group's linears against the float
output over every calibration row, ``sum((E X^T X) * E) / n`` with ``E = Q(W s) / s - W``, summed
over the group's weights (the Gram matrix gives it exactly without keeping the rows). The
alpha with the smallest loss wins (alpha = 0, s = 1, is plain RTN, so the chosen scales never
do worse than RTN on that loss).

Clipping search. For each row n and group g of a (scaled) weight, the range is clamped to
``[-c, c]`` with ``c = max|w| * (1 - i / 20)`` for i in 0..9 before RTN; the error of that
group's part of the output over every calibration token is ``d^T G_g d`` with ``d`` the
group's weight error and ``G_g`` the group's diagonal block of ``X^T X``; the c with the
smallest error wins, per row and group (i = 0 is no clipping).
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.passes.quantize_rtn import fake_quantize_w4

DEFAULT_ALPHA_GRID = tuple(index / 20 for index in range(20))
CLIP_STEPS = 20
CLIP_MAX_SHRINK = 0.5
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


def search_clip(weight: Tensor, blocks: Tensor, group_size: int) -> Tensor:
    """Per row and group, the clipping bound c [N, num_groups] that minimizes the group's output error (see above).

    `blocks` is gram_blocks' [num_groups, gs, gs] of this weight's input (scaled like the weight's columns).
    """
    weight = weight.float()
    rows = weight.shape[0]
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
