"""Tensor parallelism of octavo.moe: every expert split by its intermediate columns (used by shard_tensor_parallel).

Why not expert parallelism (whole experts per rank): a decode step routes each token to top_k experts,
so with a few tokens per step the experts a step reads sit on at most top_k * tokens ranks and the
others wait; the step then takes as long as reading whole experts on one rank. Splitting every expert
across the ranks gives each rank 1/tp of every chosen expert's weights to read (a step reads 1/tp of the
active bytes per rank, the rank's share of the work is even whatever the routing), for the same one
all_reduce per MoE layer a dense MLP costs; the octavo runtime's collectives (all_reduce, all_gather) need
no all-to-all token exchange either. Routing is replicated: every rank holds the whole router and
computes the same choice from the same (replicated) hidden states.

Rank r keeps, of every expert, the gate rows and up rows ``[r*I/tp, (r+1)*I/tp)`` of gate_up [E, 2I, H]
and the matching input columns of down [E, H, I], quantized experts included (w8/w4 scales and offsets
follow their rows; for grouped scales the columns must fall on group boundaries, for w4 on bytes).
"""

from __future__ import annotations

import torch

from octavo.errors import PassError
from octavo.passes.tensor_parallel_layout import even_share

# octavo.moe's arguments: x, router_weight, gate_up, down, top_k, normalize, activation, round_weights,
# gate_up_scales, gate_up_offsets, down_scales, down_offsets, group_size.
GATE_UP, DOWN = 2, 3
GATE_UP_PARAMETERS, DOWN_PARAMETERS = (2, 8, 9), (3, 10, 11)
GROUP_SIZE = 12


def expert_shard(args: tuple, weights: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> dict:
    """{argument index: (key, slicing function)} for the rank's part of every expert weight of one moe node."""
    gate_up = weights[args[GATE_UP].name]
    intermediate = int(gate_up.shape[1]) // 2
    columns = even_share(intermediate, tp_size, tp_rank, "expert intermediate size")
    rows = [columns, range(intermediate + columns.start, intermediate + columns.stop)]
    slices = {}
    for index in GATE_UP_PARAMETERS:
        if len(args) > index and args[index] is not None:
            slices[index] = (("expert rows", tuple((r.start, r.stop) for r in rows)),
                             lambda tensor, rows=rows: torch.cat([tensor[:, r.start:r.stop] for r in rows], dim=1))
    quantized = len(args) > DOWN_PARAMETERS[1] and args[DOWN_PARAMETERS[1]] is not None
    packed = quantized and len(args) > DOWN_PARAMETERS[2] and args[DOWN_PARAMETERS[2]] is not None
    group_size = int(args[GROUP_SIZE]) if quantized and len(args) > GROUP_SIZE else 0
    values = _column_span(columns, 2 if packed else 1, "4-bit bytes")
    slices[DOWN] = (("expert columns", values.start, values.stop),
                    lambda tensor, span=values: tensor[:, :, span.start:span.stop].contiguous())
    if quantized:
        groups = _column_span(columns, group_size, "scale groups") if group_size else None
        for index in DOWN_PARAMETERS[1:]:
            if len(args) > index and args[index] is not None:
                slices[index] = (("expert groups", None if groups is None else (groups.start, groups.stop)),
                                 lambda tensor, span=groups: tensor if span is None
                                 else tensor[:, :, span.start:span.stop].contiguous())
    return slices


def _column_span(columns: range, per_unit: int, what: str) -> range:
    """`columns` in units of `per_unit` columns (bytes of two 4-bit values, groups of scales)."""
    if columns.start % per_unit or len(columns) % per_unit:
        raise PassError(f"tensor parallelism cannot split the experts' intermediate columns {columns.start}.."
                        f"{columns.stop} on {what} of {per_unit}")
    return range(columns.start // per_unit, columns.stop // per_unit)
