"""fuse_pointwise: the partitioner. Groups of leftover pointwise ops (+ one row reduction) -> octavo.fused_pointwise."""

from __future__ import annotations

import networkx as nx
import torch
from torch.fx import GraphModule, Node

from octavo.ir.ops.fused_pointwise import ALLOWED_KWARGS, POINTWISE_OPS, REDUCTION_OPS, Reference, encode_program
from octavo.passes.canonicalize import eliminate_dead_nodes
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import same_size, tensor_value
from octavo.passes.pointwise_partition import contracted, partition
from octavo.passes.registry import register_pass

octavo = torch.ops.octavo

_NAMES = {op: name for name, op in {**POINTWISE_OPS, **REDUCTION_OPS}.items()}
_REDUCTIONS = set(REDUCTION_OPS.values())
_LITERALS = (bool, int, float, str, type(None), torch.dtype)


@register_pass("fuse_pointwise", "group the remaining pointwise ops (and at most one last-dim reduction) into "
               "octavo.fused_pointwise nodes")
def fuse_pointwise(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace each group found by pointwise_partition.partition by one `octavo.fused_pointwise`.

    Fusible nodes: calls of the allow-listed ATen ops (octavo.ir.ops.fused_pointwise.POINTWISE_OPS,
    REDUCTION_OPS) returning one floating-point tensor, whose tensor arguments
    are floating-point tensors and whose other arguments are literals; a
    reduction must reduce the last dim with keepdim=True. A group (at least 2
    nodes, at most one reduction, one result: only its last node is used
    outside it) must be row-shaped: every member has the output's rank and
    leading dims and a last dim of W or 1 (one W per group), and every tensor
    argument broadcasts to [leading dims..., W]. The group's nodes become the
    program's steps in graph order, its outside tensor arguments the op's
    inputs (in order of first use); the last step's uses move to the new node.
    Nothing to fuse is fine (after the other fusions a decoder may have no
    pointwise op left). Stats: groups, fused_nodes, with_reduction, largest.
    """
    eliminate_dead_nodes(graph_module)
    nodes = list(graph_module.graph.nodes)
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((source, node) for node in nodes for source in node.all_input_nodes)
    fusible = [node for node in nodes if is_fusible(node)]
    reductions = [node for node in fusible if node.target in _REDUCTIONS]
    groups = partition(dag, fusible, reductions, can_add=_row_compatible)
    if not nx.is_directed_acyclic_graph(contracted(dag, groups)):
        raise AssertionError("fuse_pointwise: the partition would create a cycle")
    for group in groups:
        _replace_group(graph_module, group)
    ctx.stats.update({
        "groups": len(groups),
        "fused_nodes": sum(map(len, groups)),
        "with_reduction": sum(1 for group in groups if any(node.target in _REDUCTIONS for node in group)),
        "largest": max(map(len, groups), default=0),
    })
    return graph_module


def is_fusible(node: Node) -> bool:
    """Whether `node` may join a fused_pointwise group (see fuse_pointwise)."""
    if node.op != "call_function" or node.target not in _NAMES:
        return False
    value = tensor_value(node)
    if value is None or not value.dtype.is_floating_point:
        return False
    if set(node.kwargs) - ALLOWED_KWARGS.get(_NAMES[node.target], set()):
        return False
    if not all(_is_fusible_argument(arg) for arg in [*node.args, *node.kwargs.values()]):
        return False
    return node.target not in _REDUCTIONS or _is_row_reduction(node)


def _is_fusible_argument(arg) -> bool:
    if isinstance(arg, Node):
        value = tensor_value(arg)
        return value is not None and value.dtype.is_floating_point
    if isinstance(arg, list | tuple):
        return all(isinstance(item, int) and not isinstance(item, bool) for item in arg)
    return isinstance(arg, _LITERALS)


def _is_row_reduction(node: Node) -> bool:
    if len(node.args) != 3 or node.args[2] is not True or not isinstance(node.args[1], list | tuple):
        return False
    rank = tensor_value(node.args[0]).dim()
    return len(node.args[1]) == 1 and node.args[1][0] in (-1, rank - 1)


def _row_compatible(group: set[Node], node: Node) -> bool:
    """Whether `node` keeps `group` row-shaped (see fuse_pointwise) around its root."""
    root_value, value = tensor_value(_root(group)), tensor_value(node)
    if value.dim() != root_value.dim() or not all(map(same_size, value.shape[:-1], root_value.shape[:-1])):
        return False
    widths = [_width(tensor_value(member)) for member in group]
    widths += [_width(value)] + [_width(tensor_value(arg)) for arg in node.all_input_nodes]
    wide = [width for width in widths if not same_size(width, 1)]
    if any(not same_size(width, wide[0]) for width in wide[1:]):
        return False
    row = [*root_value.shape[:-1], wide[0] if wide else 1]
    return all(_broadcasts_to(tensor_value(arg).shape, row) for arg in node.all_input_nodes)


def _width(value: torch.Tensor):
    """The last dim (1 for a 0-d tensor, which broadcasts like one)."""
    return value.shape[-1] if value.dim() else 1


def _root(group: set[Node]) -> Node:
    """The group's root: its one member used outside it (the node the group grew from)."""
    return next(member for member in group if any(user not in group for user in member.users))


def _broadcasts_to(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(same_size(size, 1) or same_size(size, goal) for size, goal in zip(reversed(shape), reversed(target),
                                                                                  strict=False))


def _replace_group(graph_module: GraphModule, group: list[Node]) -> None:
    members = set(group)
    inputs: list[Node] = []
    step_of = {node: index for index, node in enumerate(group)}

    def encode(arg):
        if isinstance(arg, Node):
            if arg in members:
                return Reference("step", step_of[arg])
            if arg not in inputs:
                inputs.append(arg)
            return Reference("input", inputs.index(arg))
        if isinstance(arg, list | tuple):
            return [encode(item) for item in arg]
        return arg

    steps = []
    for node in group:
        args = [encode(arg) for arg in node.args]
        if node.target in _REDUCTIONS:
            args[1] = [-1]
        steps.append({"op": _NAMES[node.target], "args": args,
                      "kwargs": {key: encode(value) for key, value in node.kwargs.items()}})
    root = group[-1]
    with graph_module.graph.inserting_before(root):
        fused = graph_module.graph.call_function(octavo.fused_pointwise.default, (inputs, encode_program(steps)))
    fused.meta["val"] = root.meta.get("val")
    root.replace_all_uses_with(fused)
    for node in reversed(group):
        graph_module.graph.erase_node(node)
