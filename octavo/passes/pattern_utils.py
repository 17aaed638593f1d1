"""Small helpers the fusion passes share to recognize graph patterns."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from octavo.passes.context import PassContext

aten = torch.ops.aten


def is_call(node, *targets) -> bool:
    """Whether `node` is a call_function node of one of `targets`."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def only_user(node: Node) -> Node | None:
    """The single node that uses `node`, or None when it has no user or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def split_operands(node: Node, predicate: Callable[[object], bool]) -> tuple[Node, object] | None:
    """For a two-operand commutative call: (the operand matching `predicate`, the other one), either order."""
    if len(node.args) != 2 or node.kwargs:
        return None
    first, second = node.args
    if predicate(first):
        return first, second
    if predicate(second):
        return second, first
    return None


def is_weight(node, ctx: PassContext) -> bool:
    """Whether `node` is a weight placeholder (its tensor lives in ctx.weights)."""
    return isinstance(node, Node) and node.op == "placeholder" and node.name in ctx.weights


def tensor_value(node) -> torch.Tensor | None:
    """The fake tensor a node computes (meta["val"]), or None when it is not a single tensor."""
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def same_size(first, second) -> bool:
    """Whether two sizes (ints or SymInts) are equal for every value of the symbols, adding no guard."""
    return statically_known_true(first == second)


def same_shape(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two (fake) tensors have equal shapes for every value of the symbols."""
    return first.dim() == second.dim() and all(map(same_size, first.shape, second.shape))


def is_float_cast(node, dtype: torch.dtype | None = None) -> bool:
    """An aten._to_copy that only changes the dtype (to `dtype` when given)."""
    if not is_call(node, aten._to_copy.default) or len(node.args) != 1 or set(node.kwargs) != {"dtype"}:
        return False
    return dtype is None or node.kwargs["dtype"] == dtype


def placeholder_named(graph_module: GraphModule, name: str) -> Node | None:
    for node in graph_module.graph.find_nodes(op="placeholder"):
        if node.name == name:
            return node
    return None


def erase_chain(graph_module: GraphModule, nodes: list[Node]) -> None:
    """Erase `nodes` (given producers first) once nothing uses them, last one first."""
    for node in reversed(nodes):
        if not node.users:
            graph_module.graph.erase_node(node)
