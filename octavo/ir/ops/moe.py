"""octavo::moe: a mixture-of-experts MLP (top-k softmax routing over stacked gated experts).

The definition follows transformers' sparse MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE):
the router linear, each token's choice of experts, the chosen experts alone, and their
outputs summed with the routing weights, in one op (kernels time its three parts apart:
routing, permutation, expert GEMMs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.ir.quantized_layout import dequantize_w4, dequantize_w8

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


@torch.library.custom_op("octavo::moe", mutates_args=())
def moe(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, top_k: int, normalize: bool,
        activation: str = "silu", round_weights: bool = True, gate_up_scales: Tensor | None = None,
        gate_up_offsets: Tensor | None = None, down_scales: Tensor | None = None, down_offsets: Tensor | None = None,
        group_size: int = 0) -> Tensor:
    """Top-k routed gated experts.

    Shapes: ``x`` [T, H]; ``router_weight`` [E, H]; ``gate_up`` [E, 2I, H] (expert e's gate
    projection rows first, then its up projection rows); ``down`` [E, H, I]. Returns [T, H]
    in ``x.dtype``.

    1. Routing: ``r = x @ router_weight.T`` in ``x.dtype`` (as torch's linear computes it),
       then in float32 ``p = softmax(r.float(), -1)``; each token's experts
       are the ``top_k`` largest ``p`` (in decreasing order; equal probabilities in order of
       the expert index), their weights those ``p``; with ``normalize`` the weights are
       divided by their sum. With ``round_weights`` (Qwen-MoE, OLMoE) the weights are then
       rounded to ``x.dtype``; without (Mixtral) they stay float32.
    2. Expert e on a row ``v``: ``g, u = split(v @ gate_up[e].T)`` (the first and second I
       columns), ``y = act(g) * u``, ``out = y @ down[e].T``, each op in ``x.dtype`` as torch
       computes it; ``act`` is silu, gelu (erf) or gelu_tanh (tanh approximation).
    3. Token t's result is ``sum_j w_tj * out_{e_tj}(x_t)`` over its top_k slots j in order,
       each product in torch's promotion of the two (``x.dtype`` with rounded weights, float32
       without), accumulated in float32 and rounded once to ``x.dtype``.

    Quantized experts: ``gate_up`` and ``down`` may be in the w8 layout (int8, with
    ``*_scales`` [E, N, ceil(K / group_size)]) or the w4 layout (uint8 [E, N, K / 2], with
    ``*_scales`` and ``*_offsets``) of octavo.ir.quantized_layout, expert by expert, with
    ``group_size`` (0: one scale per output channel, a group spanning all of K); the
    projections then compute as octavo.linear_w8 / linear_w4 do (the dequantized weight and
    ``v`` in float32, one rounding to ``x.dtype``).
    """
    return moe_reference(x, router_weight, gate_up, down, top_k, normalize, activation, round_weights,
                         gate_up_scales, gate_up_offsets, down_scales, down_offsets, group_size)


@moe.register_fake
def _(x, router_weight, gate_up, down, top_k, normalize, activation="silu", round_weights=True, gate_up_scales=None,
      gate_up_offsets=None, down_scales=None, down_offsets=None, group_size=0):
    return torch.empty_like(x)


def route(x: Tensor, router_weight: Tensor, top_k: int, normalize: bool,
          dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Step 1 of the op: (weights [T, top_k] in `dtype`, experts [T, top_k] int64)."""
    probabilities = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    # A stable descending sort puts equal probabilities in expert order (torch.topk leaves their order open).
    order = torch.sort(probabilities, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probabilities.gather(1, order)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), order


def expert_weight(weight: Tensor, scales: Tensor | None, offsets: Tensor | None, group_size: int,
                  expert: int) -> Tensor:
    """Expert `expert`'s [N, K] weight: the float slice, or the quantized slice dequantized to float32."""
    if scales is None:
        return weight[expert]
    if offsets is None:
        return dequantize_w8(weight[expert], scales[expert], group_size or weight.shape[-1])
    return dequantize_w4(weight[expert], scales[expert], offsets[expert], group_size or 2 * weight.shape[-1])


def apply_activation(gate: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none")
    raise ValueError(f"moe activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def expert_forward(rows: Tensor, gate_up: Tensor, down: Tensor, activation: str) -> Tensor:
    """Step 2 on rows [n, H] of x.dtype, with one expert's weights (float, or float32 when dequantized)."""
    dtype = rows.dtype
    projected = F.linear(rows.to(gate_up.dtype), gate_up).to(dtype)
    gate, up = projected.chunk(2, dim=-1)
    hidden = apply_activation(gate, activation) * up
    return F.linear(hidden.to(down.dtype), down).to(dtype)


def moe_reference(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, top_k: int, normalize: bool,
                  activation: str = "silu", round_weights: bool = True, gate_up_scales: Tensor | None = None,
                  gate_up_offsets: Tensor | None = None, down_scales: Tensor | None = None,
                  down_offsets: Tensor | None = None, group_size: int = 0) -> Tensor:
    """The definition: every (token, slot) pair computed on its own expert, the slots summed in order."""
    weights, experts = route(x, router_weight, top_k, normalize, x.dtype if round_weights else torch.float32)
    slot_outputs = torch.zeros((*experts.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in experts.unique().tolist():
        tokens, slots = (experts == expert).nonzero(as_tuple=True)
        first = expert_weight(gate_up, gate_up_scales, gate_up_offsets, group_size, expert)
        second = expert_weight(down, down_scales, down_offsets, group_size, expert)
        out = expert_forward(x[tokens], first, second, activation)
        slot_outputs[tokens, slots] = (out * weights[tokens, slots, None]).float()
    total = slot_outputs[:, 0].clone()
    for slot in range(1, top_k):  # in slot order
        total += slot_outputs[:, slot]
    return total.to(x.dtype)
