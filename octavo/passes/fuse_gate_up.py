"""fuse_gate_up: the gate and up projections of each gated MLP -> one linear over concatenated weights."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.linear_merging import can_merge, merge_linears, mergeable_linear
from octavo.passes.pattern_utils import only_user, split_operands
from octavo.passes.registry import register_pass

aten = torch.ops.aten
GATE_ACTIVATIONS = (aten.silu.default, aten.gelu.default)
"""The activations of the gated MLPs Octavo knows: SiLU (Llama, ...) and GELU (Gemma's gelu_pytorch_tanh)."""


@register_pass("fuse_gate_up", "merge each gated MLP's gate and up projections into one linear plus a split")
def fuse_gate_up(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Merge `mul(act(linear(x, W_gate)), linear(x, W_up))` projections into one linear.

    `act` is aten.silu or aten.gelu (either approximation). For each such
    activation whose input is a linear and whose only user is a `mul` (either
    operand order) with another linear of the same input, the two linears
    become one over `cat([W_gate, W_up])` (weight `..._gate_up_proj_weight`)
    followed by `split_with_sizes([I, I], -1)`: gate first, then up, whatever
    their graph order, so that fuse_activation can hand the merged output to
    octavo.silu_and_mul / gelu_and_mul. The activation and mul stay.
    Stats: merged_gate_up (matches). Raises PassError when nothing matches in
    a model whose architecture has separate dense gate and up projections
    (Architecture.mlp "dense", not fused_projections).
    """
    activations = [node for target in GATE_ACTIVATIONS for node in find_nodes(graph_module, target)]
    pairs = [pair for activation in activations if (pair := _gate_up_pair(activation, ctx))]
    architecture = ctx.architecture
    if not pairs and architecture.mlp == "dense" and not architecture.fused_projections:
        raise PassError("fuse_gate_up found no gated MLP (act(linear(x)) * linear(x)); every dense "
                        f"architecture with separate projections ({architecture.model_type}) has one")
    for gate, up in pairs:
        merge_linears(graph_module, ctx, [gate, up], "gate_up_proj")
    ctx.stats["merged_gate_up"] = len(pairs)
    return graph_module


def _gate_up_pair(activation: Node, ctx: PassContext) -> tuple[Node, Node] | None:
    gate, multiply = activation.args[0], only_user(activation)
    if multiply is None or multiply.target is not aten.mul.Tensor or not mergeable_linear(gate, ctx):
        return None
    if len(gate.users) != 1:
        return None
    operands = split_operands(multiply, lambda arg: arg is activation)
    if operands is None or not mergeable_linear(operands[1], ctx):
        return None
    up = operands[1]
    return (gate, up) if can_merge([gate, up]) else None
