"""canonicalize: remove what torch.export leaves that does not compute anything."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from octavo.passes.context import PassContext
from octavo.passes.registry import register_pass

aten = torch.ops.aten

_ASSERT_OPS = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
    aten._assert_async.msg,
}
_IDENTITY_OPS = {aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default}


@register_pass("canonicalize", "remove asserts, no-op casts, expands and slices, aliases and dead code")
def canonicalize(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Semantics-preserving cleanup.

    Removes runtime assertions (aten._assert_*, sym_constrain_range*),
    replaces by their input: aliases/detach, `_to_copy` casts that change
    nothing (same dtype, no device or memory-format change), expands whose
    result has their input's shape, and slices that keep a whole dimension
    (start 0, end >= size, step 1); then removes dead nodes and weight inputs
    nothing reads. Stats: asserts, noop_casts, aliases, noop_expands,
    noop_slices, dead_nodes, unused_weights.
    """
    graph = graph_module.graph
    counts = {"asserts": 0, "noop_casts": 0, "aliases": 0, "noop_expands": 0, "noop_slices": 0}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERT_OPS and not node.users:
            graph.erase_node(node)
            counts["asserts"] += 1
        elif node.target in _IDENTITY_OPS:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            counts["aliases"] += 1
        elif node.target is aten._to_copy.default and _is_noop_cast(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            counts["noop_casts"] += 1
        elif node.target is aten.expand.default and _is_noop_expand(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            counts["noop_expands"] += 1
        elif is_full_slice(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            counts["noop_slices"] += 1
    counts["dead_nodes"] = eliminate_dead_nodes(graph_module)
    counts["unused_weights"] = ctx.remove_unused_weights(graph_module)
    ctx.stats.update(counts)
    return graph_module


def eliminate_dead_nodes(graph_module: GraphModule) -> int:
    """Remove nodes whose results nothing uses (ops that mutate inputs are kept). Returns how many."""
    before = len(graph_module.graph.nodes)
    graph_module.graph.eliminate_dead_code()
    return before - len(graph_module.graph.nodes)


def _is_noop_cast(node: Node) -> bool:
    source = node.args[0]
    if not isinstance(source, Node) or "val" not in source.meta or "val" not in node.meta:
        return False
    allowed = {"dtype", "layout", "device"}
    if set(node.kwargs) - allowed:
        return False
    before, after = source.meta["val"], node.meta["val"]
    return before.dtype == after.dtype and before.device == after.device and before.layout == after.layout


def _is_noop_expand(node: Node) -> bool:
    """An expand whose result has its input's shape (HF's rotary expands [1, D, 1] to batch 1, say)."""
    source = node.args[0]
    if not isinstance(source, Node) or "val" not in source.meta or "val" not in node.meta:
        return False
    before, after = source.meta["val"].shape, node.meta["val"].shape
    return len(before) == len(after) and all(statically_known_true(a == b) for a, b in zip(before, after, strict=True))


def is_full_slice(node: Node) -> bool:
    """Whether `node` is an aten.slice.Tensor that keeps its whole dimension (start 0, end >= size, step 1)."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor or node.kwargs:
        return False
    source = node.args[0]
    if not isinstance(source, Node) or "val" not in source.meta:
        return False
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    size = source.meta["val"].shape[dim]
    if start not in (0, None) or step != 1:
        return False
    if end is None or (isinstance(end, int) and end >= 2**62):
        return True
    # An end given as a node (sym_size) is compared through its traced value; ints by value, not identity.
    end_value = end.meta.get("val") if isinstance(end, Node) else end
    return isinstance(end_value, int | torch.SymInt) and statically_known_true(end_value >= size)
