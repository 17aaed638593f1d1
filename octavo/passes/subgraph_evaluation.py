"""Evaluating part of a traced graph at compile time on concrete inputs (fuse_rope's cos/sin tables)."""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from octavo.errors import PassError
from octavo.passes.context import PassContext


def ancestors(outputs: list[Node]) -> set[Node]:
    """Every node the `outputs` depend on, the outputs included."""
    seen: set[Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def evaluate_subgraph(graph_module: GraphModule, outputs: list[Node], ctx: PassContext,
                      inputs: dict[str, torch.Tensor], shape_only: dict[str, torch.Tensor] | None = None,
                      ) -> list[torch.Tensor]:
    """Run just the nodes that `outputs` need, on real tensors, and return the outputs' values.

    Placeholders the subgraph reads are fed from `inputs` (runtime inputs by
    name), from ctx.weights, or from `shape_only` — tensors for inputs whose
    values the subgraph must not read, only their sizes (aten.sym_size).
    Any other placeholder, or a value read of a shape-only input, is a PassError.
    """
    shape_only = shape_only or {}
    needed = ancestors(outputs)
    graph = Graph()
    environment: dict[Node, Node] = {}
    arguments = []
    for node in graph_module.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            arguments.append(_placeholder_value(node, needed, ctx, inputs, shape_only))
            environment[node] = graph.placeholder(node.name)
        else:
            environment[node] = graph.node_copy(node, environment.__getitem__)
    graph.output([environment[node] for node in outputs])
    with torch.no_grad():
        return list(GraphModule(torch.nn.Module(), graph)(*arguments))


def _placeholder_value(node: Node, needed: set[Node], ctx: PassContext, inputs: dict[str, torch.Tensor],
                       shape_only: dict[str, torch.Tensor]) -> torch.Tensor:
    if node.name in inputs:
        return inputs[node.name]
    if node.name in ctx.weights:
        return ctx.weights[node.name]
    if node.name in shape_only:
        readers = [user for user in node.users if user in needed]
        if any(user.target is not torch.ops.aten.sym_size.int for user in readers):
            raise PassError(f"the subgraph to evaluate reads the values of {node.name}, not only its size")
        return shape_only[node.name]
    raise PassError(f"the subgraph to evaluate reads input {node.name}, which is not known at compile time")
