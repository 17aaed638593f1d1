"""GPTQ (Frantar et al. 2022): 4-bit group-wise rounding of one linear's weight with error feedback.

For a linear ``y = x W^T`` (W [N, K]) and calibration inputs X [n, K], GPTQ minimizes
``||X W^T - X Q^T||^2`` over the quantized Q, column by column, using the Hessian of that
error, ``H = 2 X^T X / n`` (``octavo.ir.linear_input_stats.LinearInputStats.hessian``):

1. Columns whose input was always zero (``H[k, k] == 0``) get ``H[k, k] = 1`` and ``W[:, k] = 0``.
2. Damping: ``H += damping * mean(diag(H)) * I`` (doubled up to 10 times while H is not
   positive definite).
3. ``U = cholesky(H^-1, upper=True)``: row k of U holds the OBS update of the columns after
   k when column k is rounded (the paper's Cholesky reformulation).
4. Columns are processed in blocks of ``block_size`` (lazy batch updates): inside a block,
   column k is rounded to ``q_k`` with its group's scale and offset, its error
   ``e_k = (w_k - q_k) / U[k, k]`` is fed back into the block's later columns
   (``W[:, j] -= e_k U[k, j]``); after the block, all its errors update the remaining
   columns at once (``W[:, rest] -= E U[block, rest]``).
5. Groups (the w4 layout's, ``g = k // group_size``, the last one shorter when K is not a
   multiple): without act-order, a group's scale and offset are fixed from its columns as
   they are when the group's first column is reached (after the feedback so far);
   ``block_size`` is a multiple of ``group_size`` so groups never straddle blocks. Each row's
   range is searched (``range_search``, the default): the min/max range [lo, hi] loses the
   fractions (bottom, top) of hi - lo at its ends, for each pair of ``range_cuts`` (by default
   quantize_rtn.DEFAULT_RANGE_CUTS: each end on its own by 0, 0.05, ..., 0.25, 36 candidates;
   (0, 0) first in every set), keeping the first candidate whose rounding
   error ``sum_k H[k, k] (w_k - dequantized w_k)^2`` over the group is least (the layer-output
   error of rounding the group's columns alone, cross terms ignored: a range cut short of an
   outlier of a little-used column buys finer steps for the rest); without it, the min/max
   range itself (RTN's).
   With act-order, columns are processed by decreasing ``H[k, k]``; since the layout stores
   no permutation (group of column k is always ``k // group_size``), every group's scale and
   offset are fixed up front from the weight before any update ("static groups" of the
   reference implementation; searched the same way) and each column is rounded with its own
   group's values.

The rounding is the w4 layout's asymmetric form (see quantize_rtn): ``q = clamp(round((w - offset) /
scale), 0, 15)`` with the float16 (or float32) scale and offset that are stored, so the stored
tensors dequantize to exactly the values the error feedback used.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from octavo.ir.quantized_layout import W4, QuantizedWeight, num_groups, pack_int4
from octavo.passes.quantize_rtn import DEFAULT_RANGE_CUTS, w4_levels, w4_range_params, w4_scale_dtype

logger = logging.getLogger(__name__)

DEFAULT_DAMPING = 0.01
DEFAULT_BLOCK_COLUMNS = 128
GPTQ_RANGE_ERROR = "sum_k H[k, k] (w_k - q_k)^2 over the group"
_MAX_DAMPING_RETRIES = 10


def gptq_quantize(weight: Tensor, hessian: Tensor, group_size: int, damping: float = DEFAULT_DAMPING,
                  act_order: bool = False, block_columns: int = DEFAULT_BLOCK_COLUMNS,
                  range_search: bool = True, range_cuts: tuple[tuple[float, float], ...] = DEFAULT_RANGE_CUTS,
                  ) -> tuple[QuantizedWeight, dict]:
    """The w4 QuantizedWeight GPTQ gives for `weight` [N, K] under `hessian` [K, K] (see the module docstring;
    `range_search` False: every group on its min/max range; else searched over `range_cuts`).

    Returns it with a record: the damping actually added (relative to mean(diag H)) and the
    number of dead (never activated) columns.
    """
    work = weight.detach().float().clone()
    rows, columns = work.shape
    if columns % 2:
        raise ValueError(f"w4 needs an even number of input features, got {columns}")
    hessian = hessian.detach().float().clone()
    dead = torch.diagonal(hessian) == 0
    hessian[dead, dead] = 1.0
    work[:, dead] = 0.0
    scale_dtype = w4_scale_dtype(work)
    importance = torch.diagonal(hessian).clone() if range_search else None
    cuts = torch.tensor(range_cuts, dtype=torch.float32)
    static = _group_params(work, group_size, scale_dtype, importance, cuts) if act_order else None
    order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True) if act_order else None
    if order is not None:
        work, hessian = work[:, order], hessian[order][:, order]
    upper, relative_damping = _inverse_cholesky(hessian, damping)
    levels = torch.zeros_like(work)
    groups = num_groups(columns, group_size)
    scales = torch.zeros(rows, groups, dtype=scale_dtype)
    offsets = torch.zeros(rows, groups, dtype=scale_dtype)
    block = group_size * max(1, block_columns // group_size)
    for start in range(0, columns, block):
        end = min(start + block, columns)
        errors = _quantize_block(work, upper, levels, scales, offsets, start, end, group_size, static, order,
                                 importance, cuts)
        work[:, end:].addmm_(errors, upper[start:end, end:], alpha=-1.0)
    if order is not None:
        levels = levels[:, torch.argsort(order)]
        scales, offsets = static
    quantized = QuantizedWeight(W4, pack_int4(levels.to(torch.uint8)), scales.contiguous(), offsets.contiguous(),
                                group_size, "gptq")
    return quantized, {"damping": relative_damping, "dead_columns": int(dead.sum())}


def _quantize_block(work: Tensor, upper: Tensor, levels: Tensor, scales: Tensor, offsets: Tensor, start: int,
                    end: int, group_size: int, static: tuple[Tensor, Tensor] | None,
                    order: Tensor | None, importance: Tensor | None, cuts: Tensor) -> Tensor:
    """Round columns start..end-1 of `work` in place of `levels`, feeding each error forward; returns the errors."""
    block = work[:, start:end]  # a view: the feedback inside the block updates `work`
    inverse = upper[start:end, start:end]
    errors = torch.empty_like(block)
    group_scale = group_offset = None
    for index in range(end - start):
        column = start + index
        if static is not None:
            group = int(order[column]) // group_size
            group_scale, group_offset = static[0][:, group], static[1][:, group]
        elif column % group_size == 0:
            group_scale, group_offset = _group_range(work, column, min(column + group_size, work.shape[1]),
                                                     importance, scales.dtype, cuts)
            scales[:, column // group_size], offsets[:, column // group_size] = group_scale, group_offset
        original = block[:, index]
        q = w4_levels(original, group_scale, group_offset)
        levels[:, column] = q
        error = (original - (q * group_scale.float() + group_offset.float())) / inverse[index, index]
        block[:, index + 1:].addr_(error, inverse[index, index + 1:], alpha=-1.0)
        errors[:, index] = error
    return errors


def _group_range(weight: Tensor, first: int, end: int, importance: Tensor | None,
                 scale_dtype: torch.dtype, cuts: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, the (scale, offset) of columns first..end-1 of `weight`: their min/max range, or with
    `importance` the searched one (_searched_range)."""
    values = weight[:, first:end]
    if importance is None:
        return w4_range_params(values.amin(1), values.amax(1), scale_dtype)
    return _searched_range(values, importance[first:end], scale_dtype, cuts)


def _searched_range(values: Tensor, importance: Tensor, scale_dtype: torch.dtype,
                    cuts: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, the (scale, offset) of the range [lo + bottom (hi - lo), hi - top (hi - lo)] over the (bottom, top)
    rows of `cuts` [C, 2] that minimizes sum_k importance[k] * (w_k - dequantized w_k)^2 over the group (the
    first such cut on ties)."""
    lowest, highest = values.amin(1), values.amax(1)
    width = highest - lowest
    scales, offsets = w4_range_params(lowest + cuts[:, :1] * width, highest - cuts[:, 1:] * width, scale_dtype)
    levels = w4_levels(values, scales[:, :, None], offsets[:, :, None])
    dequantized = levels * scales.float()[:, :, None] + offsets.float()[:, :, None]
    best = (((dequantized - values) ** 2) * importance).sum(2).argmin(0, keepdim=True)
    return scales.gather(0, best).squeeze(0), offsets.gather(0, best).squeeze(0)


def _group_params(weight: Tensor, group_size: int, scale_dtype: torch.dtype,
                  importance: Tensor | None, cuts: Tensor) -> tuple[Tensor, Tensor]:
    """(scales, offsets) [N, num_groups] of every group of `weight` (_group_range), the last possibly shorter."""
    columns = weight.shape[1]
    ranges = [_group_range(weight, start, min(start + group_size, columns), importance, scale_dtype, cuts)
              for start in range(0, columns, group_size)]
    return torch.stack([scale for scale, _ in ranges], dim=1), torch.stack([offset for _, offset in ranges], dim=1)


def _inverse_cholesky(hessian: Tensor, damping: float) -> tuple[Tensor, float]:
    """Upper Cholesky factor of the damped H's inverse, and the relative damping that made H positive definite."""
    mean_diagonal = float(torch.diagonal(hessian).mean())
    relative = damping
    for _ in range(_MAX_DAMPING_RETRIES):
        damped = hessian + torch.eye(hessian.shape[0]) * (relative * mean_diagonal)
        factor, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(factor)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper, relative
        logger.info("GPTQ: H + %.3g mean(diag H) I is not positive definite; doubling the damping", relative)
        relative *= 2
    raise ValueError(f"GPTQ: the Hessian stays singular with damping {relative / 2:g} x mean(diag H)")
