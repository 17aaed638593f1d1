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

Level refit (not in the paper). A group's 16 levels ``q * scale + offset`` need not span a
range of the grid: with the codes q of the chosen range fixed, the (scale, offset) of least
``d^T G_g d`` solves a 2 x 2 weighted least-squares problem in closed form. refine_group_params
alternates that solve with re-rounding the group's values to the new levels, a few times, and
keeps a group's new levels only where its error (with scale and offset rounded to their stored
dtype) is below the best so far, so it never does worse than the range search on that error.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.passes.quantize_rtn import (
    DEFAULT_RANGE_CUTS,
    fake_quantize_w4,
    grouped_columns,
    w4_levels,
    w4_range_params,
    w4_rounded_on_range,
    w4_scale_dtype,
)

DEFAULT_ALPHA_GRID = tuple(index / 20 for index in range(20))
REFIT_ROUNDS = 4
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


def refine_group_params(weight: Tensor, blocks: Tensor, group_size: int, low: Tensor, high: Tensor,
                        rounds: int = REFIT_ROUNDS) -> tuple[Tensor, Tensor]:
    """(scales, offsets) [N, num_groups], in w4's scale dtype for `weight`, refitted from the ranges [low, high].

    Starts from the levels of each group's range (``offset = low``, ``scale = (high - low) / 15``).
    Each round: q = the codes of the group's values on the current levels (clamped to 0..15); the
    (scale, offset) minimizing ``d^T G_g d`` with ``d = q * scale + offset - w`` (the normal
    equations of the two unknowns, solved in float64); rounded to the scale dtype; a group takes
    them only where the scale is positive and its error is below its best so far. `blocks` as
    search_range takes them.
    """
    grouped = grouped_columns(weight.float(), group_size)
    scales, offsets = w4_range_params(low, high, w4_scale_dtype(weight))
    best_error = _group_errors(grouped, scales, offsets, blocks)
    blocks64, grouped64 = blocks.double(), grouped.double()
    gram_ones = blocks64.sum(-1)                                   # G_g 1, [G, gs]
    ones_gram_ones = gram_ones.sum(-1)                             # 1^T G_g 1, [G]
    ones_gram_w = torch.einsum("ngi,gi->ng", grouped64, gram_ones)  # 1^T G_g w
    for _ in range(rounds):
        q = w4_levels(grouped, scales.unsqueeze(-1), offsets.unsqueeze(-1)).double()
        gram_q = torch.einsum("gij,ngj->ngi", blocks64, q)
        q_gram_q, ones_gram_q = (q * gram_q).sum(-1), gram_q.sum(-1)
        w_gram_q = (grouped64 * gram_q).sum(-1)
        det = q_gram_q * ones_gram_ones - ones_gram_q ** 2
        solvable = det > 1e-9 * q_gram_q * ones_gram_ones
        safe_det = torch.where(solvable, det, torch.ones_like(det))
        new_scales = ((w_gram_q * ones_gram_ones - ones_gram_w * ones_gram_q) / safe_det).to(scales.dtype)
        new_offsets = ((q_gram_q * ones_gram_w - ones_gram_q * w_gram_q) / safe_det).to(offsets.dtype)
        valid = solvable & (new_scales > 0) & torch.isfinite(new_scales) & torch.isfinite(new_offsets)
        error = _group_errors(grouped, torch.where(valid, new_scales, scales),
                              torch.where(valid, new_offsets, offsets), blocks)
        better = valid & (error < best_error)
        if not bool(better.any()):
            break
        scales = torch.where(better, new_scales, scales)
        offsets = torch.where(better, new_offsets, offsets)
        best_error = torch.where(better, error, best_error)
    return scales, offsets


def _group_errors(grouped: Tensor, scales: Tensor, offsets: Tensor, blocks: Tensor) -> Tensor:
    """``d^T G_g d`` per row and group [N, G] for the values w4 stores on (scales, offsets)."""
    levels = w4_levels(grouped, scales.unsqueeze(-1), offsets.unsqueeze(-1))
    error = levels * scales.unsqueeze(-1).float() + offsets.unsqueeze(-1).float() - grouped
    return torch.einsum("ngi,gij,ngj->ng", error, blocks, error)
