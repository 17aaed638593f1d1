"""Merging linears that read one input into one linear over concatenated weights (fuse_qkv, fuse_gate_up)."""

from __future__ import annotations

import operator
import re

import torch
from torch.fx import GraphModule, Node

from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, is_weight, tensor_value

aten = torch.ops.aten


def mergeable_linear(node, ctx: PassContext) -> bool:
    """An aten.linear(x, weight[, bias]) whose weight (and bias) are weight placeholders used by it alone."""
    if not is_call(node, aten.linear.default) or node.kwargs or len(node.args) not in (2, 3):
        return False
    parameters = [arg for arg in node.args[1:] if arg is not None]
    return all(is_weight(arg, ctx) and len(arg.users) == 1 for arg in parameters)


def can_merge(linears: list[Node]) -> bool:
    """Whether `linears` read the same input and have weights of one dtype and in_features, biases alike."""
    first = linears[0]
    if any(linear.args[0] is not first.args[0] for linear in linears):
        return False
    weights = [tensor_value(linear.args[1]) for linear in linears]
    if any(weight is None or weight.dim() != 2 for weight in weights):
        return False
    if len({(weight.dtype, int(weight.shape[1])) for weight in weights}) != 1:
        return False
    has_bias = [len(linear.args) == 3 and linear.args[2] is not None for linear in linears]
    return all(has_bias) or not any(has_bias)


def merge_linears(graph_module: GraphModule, ctx: PassContext, linears: list[Node], tag: str) -> Node:
    """Replace `linears` (checked by can_merge; the order sets the split order) by one merged linear.

    The new weight `<common prefix><tag>_weight` is the row concatenation
    (torch.cat along dim 0) of the old weights, likewise the bias; the old
    weight placeholders and tensors are removed (ctx.merged_weights records
    the merged weight's parts, in order). The merged linear sits
    where the earliest of `linears` was, followed by
    `aten.split_with_sizes(merged, out_features, -1)` and one getitem per
    old linear, which takes over that linear's uses. Returns the merged node.
    """
    graph = graph_module.graph
    weights = [linear.args[1] for linear in linears]
    biases = [linear.args[2] for linear in linears if len(linear.args) == 3 and linear.args[2] is not None]
    sizes = [int(tensor_value(weight).shape[0]) for weight in weights]
    weight_name = merged_name(weights, tag, ctx)
    ctx.merged_weights[weight_name] = [node.name for node in weights]
    weight = ctx.add_weight(graph_module, weight_name,
                            torch.cat([ctx.weights[node.name] for node in weights], dim=0))
    arguments = [linears[0].args[0], weight]
    if biases:
        arguments.append(ctx.add_weight(graph_module, merged_name(biases, tag, ctx),
                                        torch.cat([ctx.weights[node.name] for node in biases], dim=0)))
    position = {node: index for index, node in enumerate(graph.nodes)}
    earliest = min(linears, key=position.__getitem__)
    with graph.inserting_before(earliest):
        merged = graph.call_function(aten.linear.default, tuple(arguments))
        split = graph.call_function(aten.split_with_sizes.default, (merged, sizes, -1))
        parts = [graph.call_function(operator.getitem, (split, index)) for index in range(len(linears))]
    for linear, part in zip(linears, parts, strict=True):
        part.meta["val"] = linear.meta.get("val")
        linear.replace_all_uses_with(part)
        graph.erase_node(linear)
    for parameter in [*weights, *biases]:
        graph.erase_node(parameter)
        del ctx.weights[parameter.name]
    return merged


def merged_name(parameters: list[Node], tag: str, ctx: PassContext) -> str:
    """`model_layers_0_self_attn_` + `qkv_proj` + `_weight`: the names' common prefix up to an underscore."""
    names = [node.name for node in parameters]
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    prefix = prefix[: prefix.rfind("_") + 1]
    suffix = re.search(r"_(weight|bias)$", names[0])
    base = f"{prefix}{tag}{suffix.group(0) if suffix else ''}"
    candidate, index = base, 1
    while candidate in ctx.weights:
        candidate, index = f"{base}_{index}", index + 1
    return candidate
