"""Torch (CPU) kernel for octavo.moe: the token-slot pairs sorted by expert, each selected expert run once."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.profiler import record_function

from octavo.ir.ops.moe import expert_forward, expert_weight, route


def moe(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, top_k: int, normalize: bool,
        activation: str = "silu", round_weights: bool = True, gate_up_scales: Tensor | None = None,
        gate_up_offsets: Tensor | None = None, down_scales: Tensor | None = None, down_offsets: Tensor | None = None,
        group_size: int = 0) -> Tensor:
    """Same semantics as octavo.ir.ops.moe.moe (see its docstring), bit for bit.

    The T * top_k (token, slot) pairs are sorted by expert once (stable, so each expert's
    rows keep token order, as the reference takes them); every expert that some token chose
    then runs on its rows in one pair of matmuls. Experts no token chose are never read.
    """
    with record_function("octavo_torch::moe_routing"):
        weights, experts = route(x, router_weight, top_k, normalize, x.dtype if round_weights else torch.float32)
    with record_function("octavo_torch::moe_permutation"):
        flat = experts.flatten()
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        slot_outputs = torch.zeros((flat.numel(), x.shape[1]), dtype=torch.float32, device=x.device)
        flat_weights = weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = order[start:start + count]
        start += count
        with record_function("octavo_torch::moe_experts"):
            first = expert_weight(gate_up, gate_up_scales, gate_up_offsets, group_size, expert)
            second = expert_weight(down, down_scales, down_offsets, group_size, expert)
            out = expert_forward(x[rows // top_k], first, second, activation)
        slot_outputs[rows] = (out * flat_weights[rows, None]).float()
    with record_function("octavo_torch::moe_permutation"):
        per_slot = slot_outputs.view(x.shape[0], top_k, x.shape[1])
        total = per_slot[:, 0].clone()
        for slot in range(1, top_k):
            total += per_slot[:, slot]
        return total.to(x.dtype)
