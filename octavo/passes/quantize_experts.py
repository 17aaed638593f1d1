"""The expert weights of octavo.moe nodes in the w8 / w4 layouts (part of quantize_weights).

Each expert's [N, K] matrix of the stacked gate_up [E, 2I, H] and down [E, H, I] weights is
quantized on its own, round-to-nearest, in the scheme's layout and group size (per-channel int8
for w8), and the expert results stacked: qweight [E, N, K] (w4: [E, N, K / 2]), scales (and w4
offsets) [E, N, groups]. The node then passes them as octavo.moe's quantized arguments, so by the
op's definition each expert computes on its dequantized weights. Calibrated schemes (AWQ, GPTQ)
quantize experts round-to-nearest too: their statistics are per linear input, and an expert's
input is the share of the tokens routed to it, which the calibration run does not record. The
router weight stays float (it picks the experts: a rounding there would change the routing).
fp8 has no expert kernel: the experts then stay float, recorded with that reason.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from octavo.ir.graph import find_nodes
from octavo.ir.quantized_layout import W4, W8
from octavo.passes.context import PassContext
from octavo.passes.quant_schemes import QuantScheme, rtn

octavo = torch.ops.octavo
_WEIGHT_ARGUMENTS = {"gate_up": 2, "down": 3}
_QUANTIZED_ARGUMENTS = 8  # octavo.moe's gate_up_scales: gate_up_offsets, down_scales, down_offsets, group_size follow


def quantize_experts(graph_module: GraphModule, ctx: PassContext, scheme: QuantScheme,
                     left_float: dict[str, list[str]]) -> int:
    """Quantize the experts of every octavo.moe node (see the module docstring); returns how many nodes."""
    nodes = find_nodes(graph_module, octavo.moe.default)
    if not nodes:
        return 0
    if scheme.layout not in (W8, W4):
        left_float.setdefault(f"{scheme.layout} has no expert kernel: experts stay float", []).extend(
            node.args[index].name for node in nodes for index in _WEIGHT_ARGUMENTS.values())
        return 0
    for node in nodes:
        _quantize_node(graph_module, ctx, scheme, node)
    return len(nodes)


def _quantize_node(graph_module: GraphModule, ctx: PassContext, scheme: QuantScheme, node: Node) -> None:
    quantized = {}
    for role, index in _WEIGHT_ARGUMENTS.items():
        weight = node.args[index]
        parts = [rtn(scheme.layout, expert, scheme.group_size) for expert in ctx.weights[weight.name].float()]
        base = weight.name.removesuffix("_weight")
        tensors = {name: torch.stack([getattr(part, name) for part in parts]) for name in ("qweight", "scales")}
        if scheme.layout == W4:
            tensors["offsets"] = torch.stack([part.offsets for part in parts])
        quantized[role] = {name: ctx.add_weight(graph_module, f"{base}_{name}", tensor)
                           for name, tensor in tensors.items()}
        quantized[role]["group_size"] = parts[0].group_size
    # Per-channel w8 (a group spanning each projection's whole K, H and I) is octavo.moe's group_size 0.
    group_size = 0 if scheme.group_size is None else quantized["gate_up"]["group_size"]
    args = list(node.args) + [None] * (_QUANTIZED_ARGUMENTS - len(node.args))
    args[2], args[3] = quantized["gate_up"]["qweight"], quantized["down"]["qweight"]
    node.args = (*args[:_QUANTIZED_ARGUMENTS], quantized["gate_up"]["scales"], quantized["gate_up"].get("offsets"),
                 quantized["down"]["scales"], quantized["down"].get("offsets"), group_size)
    ctx.remove_unused_weights(graph_module)
