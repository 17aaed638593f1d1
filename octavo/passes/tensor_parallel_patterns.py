"""Graph shapes shard_tensor_parallel recognizes: gated MLPs, head counts in views, the lm_head."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.ops.fused_pointwise import decode_program
from octavo.passes.pattern_utils import is_call
from octavo.passes.tensor_parallel_weights import LINEARS

aten = torch.ops.aten
octavo = torch.ops.octavo

VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def gate_and_up(node: Node) -> tuple[Node, Node] | None:
    """(gate input, up input) of `mul(silu(gate), up)` (either operand order), or of a fused_pointwise whose
    program is exactly that; None for anything else."""
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        first, second = node.args
        if is_call(first, aten.silu.default):
            return first.args[0], second
        if is_call(second, aten.silu.default):
            return second.args[0], first
        return None
    if not is_call(node, octavo.fused_pointwise.default) or len(node.args[0]) != 2:
        return None
    steps = decode_program(node.args[1])
    if len(steps) != 2 or steps[0].op is not aten.silu.default or steps[1].op is not aten.mul.Tensor:
        return None
    silu_input, operands = steps[0].args[0], steps[1].args
    if silu_input.kind != "input" or len(operands) != 2 or steps[0].kwargs or steps[1].kwargs:
        return None
    step_reference = [operand for operand in operands if operand.kind == "step" and operand.index == 0]
    up_reference = [operand for operand in operands if operand.kind == "input" and operand.index != silu_input.index]
    if len(step_reference) != 1 or len(up_reference) != 1:
        return None
    inputs = node.args[0]
    return inputs[silu_input.index], inputs[up_reference[0].index]


def rewrite_head_counts(path: list[Node], total: int, local: int, head_dim: int) -> None:
    """In the views of `path`, a head count `total` (any dim but the last) becomes `local`, and a last dim
    of `total * head_dim` (heads flattened) becomes `local * head_dim`."""
    if total == local:
        return
    for node in path:
        if not is_call(node, *VIEWS):
            continue
        shape = list(node.args[1])
        last = len(shape) - 1
        new = [local if index < last and dim == total and isinstance(dim, int)
               else local * head_dim if index == last and dim == total * head_dim and isinstance(dim, int)
               else dim for index, dim in enumerate(shape)]
        node.args = (node.args[0], new, *node.args[2:])


_OUTPUT_PASS_THROUGH = (aten.select.int, aten.view.default, aten._to_copy.default, aten.slice.Tensor,
                        aten.squeeze.dim, aten.clone.default, aten.reshape.default, aten._unsafe_view.default)


def find_lm_head(graph_module: GraphModule) -> Node:
    node = graph_module.graph.output_node().args[0]
    while is_call(node, *_OUTPUT_PASS_THROUGH):
        node = node.args[0]
    if not is_call(node, *LINEARS):
        raise PassError("shard_tensor_parallel found no lm_head linear feeding the graph output")
    return node
