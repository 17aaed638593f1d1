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
from octavo.passes.quantize_rtn import DEFAULT_RANGE_CUTS, W4Rounding, w4_range_params, w4_scale_dtype

logger = logging.getLogger(__name__)

DEFAULT_DAMPING = 0.01
DEFAULT_BLOCK_COLUMNS = 128
GPTQ_RANGE_ERROR = "sum_k H[k, k] (w_k - q_k)^2 over the group"
_MAX_DAMPING_RETRIES = 10
_SEARCH_CHUNK_ELEMENTS = 1 << 21


def gptq_quantize(weight: Tensor, hessian: Tensor, group_size: int, damping: float = DEFAULT_DAMPING,
                  act_order: bool = False, block_columns: int = DEFAULT_BLOCK_COLUMNS,
                  range_search: bool = True, range_cuts: tuple[tuple[float, float], ...] = DEFAULT_RANGE_CUTS,
                  ) -> tuple[QuantizedWeight, dict]:
    """The w4 QuantizedWeight GPTQ gives for `weight` [N, K] under `hessian` [K, K] (see the module docstring;
    `range_search` False: every group on its min/max range; else searched over `range_cuts`).

    Returns it with a record: the damping actually added (relative to mean(diag H)) and the
    number of dead (never activated) columns.
    """
    rows, columns = weight.shape
    if columns % 2:
        raise ValueError(f"w4 needs an even number of input features, got {columns}")
    # The solver walks W's columns one at a time: held transposed ([K, N]), each is a contiguous row.
    work = weight.detach().float().t().contiguous()
    hessian = hessian.detach().float().clone()
    dead = torch.diagonal(hessian) == 0
    hessian[dead, dead] = 1.0
    work[dead] = 0.0
    scale_dtype = w4_scale_dtype(work)
    importance = torch.diagonal(hessian).clone() if range_search else None
    static = _group_params(work, group_size, scale_dtype, importance, range_cuts) if act_order else None
    order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True) if act_order else None
    if order is not None:
        work, hessian = work[order], hessian[order][:, order]
    upper, relative_damping = _inverse_cholesky(hessian, damping)
    levels = torch.empty_like(work)
    groups = num_groups(columns, group_size)
    scales = torch.zeros(rows, groups, dtype=scale_dtype)
    offsets = torch.zeros(rows, groups, dtype=scale_dtype)
    solver = _ColumnSolver(work, upper, levels, group_size, importance, range_cuts, scales, offsets)
    if static is not None:
        solver.use_static_groups(*static, order)
    block = group_size * max(1, block_columns // group_size)
    for start in range(0, columns, block):
        end = min(start + block, columns)
        errors = solver.quantize_block(start, end)
        work[end:].addmm_(upper[start:end, end:].t(), errors, alpha=-1.0)
    if order is not None:
        levels = levels[torch.argsort(order)]
        scales, offsets = static
    packed = pack_int4(levels.to(torch.uint8).t().contiguous())
    quantized = QuantizedWeight(W4, packed, scales.contiguous(), offsets.contiguous(), group_size, "gptq")
    return quantized, {"damping": relative_damping, "dead_columns": int(dead.sum())}


class _ColumnSolver:
    """Rounds the columns of the transposed weight `work` [K, N] block by block, writing their levels into
    `levels` [K, N] and (groups fixed as they are reached) the groups' `scales` and `offsets` [N, G]."""

    def __init__(self, work: Tensor, upper: Tensor, levels: Tensor, group_size: int, importance: Tensor | None,
                 cuts: tuple[tuple[float, float], ...], scales: Tensor, offsets: Tensor) -> None:
        self.work, self.upper, self.levels, self.group_size = work, upper, levels, group_size
        self.importance, self.cuts, self.scales, self.offsets = importance, cuts, scales, offsets
        self.column_groups: list[W4Rounding] | None = None
        self.current: W4Rounding | None = None

    def use_static_groups(self, scales: Tensor, offsets: Tensor, order: Tensor) -> None:
        """Act-order: column i of `work` is W's column order[i], rounded with its own group's fixed values."""
        groups = [W4Rounding(scales[:, group], offsets[:, group]) for group in range(scales.shape[1])]
        self.column_groups = [groups[column // self.group_size] for column in order.tolist()]

    def quantize_block(self, start: int, end: int) -> Tensor:
        """Round columns start..end-1, feeding each one's error into the block's later columns; returns the
        block's errors [end - start, N] (``(w_k - q_k) / U[k, k]``) for the update of the columns after it."""
        block = self.work[start:end]
        inverse = self.upper[start:end, start:end]
        diagonal = torch.diagonal(inverse).tolist()
        errors = torch.empty_like(block)
        for index in range(end - start):
            rounding = self._rounding(start + index)
            column, error = block[index], errors[index]
            rounding.dequantized(rounding.levels(column, out=self.levels[start + index]), out=error)
            torch.sub(column, error, out=error).div_(diagonal[index])
            block[index + 1:].addr_(inverse[index, index + 1:], error, alpha=-1.0)
        return errors

    def _rounding(self, column: int) -> W4Rounding:
        if self.column_groups is not None:
            return self.column_groups[column]
        if column % self.group_size == 0:
            group = column // self.group_size
            end = min(column + self.group_size, self.work.shape[0])
            scale, offset = _group_range(self.work[column:end], self.importance, column, self.scales.dtype, self.cuts)
            self.scales[:, group], self.offsets[:, group] = scale, offset
            self.current = W4Rounding(scale, offset)
        return self.current


def _group_range(values: Tensor, importance: Tensor | None, first: int, scale_dtype: torch.dtype,
                 cuts: tuple[tuple[float, float], ...]) -> tuple[Tensor, Tensor]:
    """Per row of W, the (scale, offset) of the group whose columns are the rows of `values` [g, N], the first
    being column `first`: their min/max range, or with `importance` the searched one (_searched_range)."""
    if importance is None:
        return w4_range_params(values.amin(0), values.amax(0), scale_dtype)
    return _searched_range(values, importance[first:first + values.shape[0]], scale_dtype, cuts)


def _searched_range(values: Tensor, importance: Tensor, scale_dtype: torch.dtype,
                    cuts: tuple[tuple[float, float], ...]) -> tuple[Tensor, Tensor]:
    """Per row of W, the (scale, offset) of the range [lo + bottom (hi - lo), hi - top (hi - lo)] over the
    (bottom, top) pairs of `cuts` that minimizes sum_k importance[k] * (w_k - dequantized w_k)^2 over the
    group (the first such cut on ties); `values` [g, N] holds the group's columns as rows.

    Candidates are evaluated a few at a time: enough per chunk to keep the number of tensor operations
    small, few enough that a chunk's temporaries stay near the cache's size."""
    lowest, highest = values.amin(0), values.amax(0)
    width = highest - lowest
    fractions = torch.tensor(cuts, dtype=torch.float32)
    scales, offsets = w4_range_params(lowest + fractions[:, :1] * width, highest - fractions[:, 1:] * width,
                                      scale_dtype)  # [C, N]: every candidate's
    per_chunk = max(1, _SEARCH_CHUNK_ELEMENTS // values.numel())
    errors = []
    for first in range(0, len(cuts), per_chunk):
        rounding = W4Rounding(scales[first:first + per_chunk, None], offsets[first:first + per_chunk, None])
        squares = rounding.dequantized(rounding.levels(values)).sub_(values).square_()  # [c, g, N]
        errors.append(torch.matmul(importance, squares))  # [c, N]
    best = torch.cat(errors).argmin(0, keepdim=True)  # the first candidate on ties
    return scales.gather(0, best)[0], offsets.gather(0, best)[0]


def _group_params(work: Tensor, group_size: int, scale_dtype: torch.dtype, importance: Tensor | None,
                  cuts: tuple[tuple[float, float], ...]) -> tuple[Tensor, Tensor]:
    """(scales, offsets) [N, num_groups] of every group of the transposed weight `work` [K, N] (_group_range),
    the last possibly shorter."""
    columns = work.shape[0]
    ranges = [_group_range(work[start:start + group_size], importance, start, scale_dtype, cuts)
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
