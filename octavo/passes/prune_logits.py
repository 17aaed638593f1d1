"""prune_logits: compute the lm_head only on the token rows the sampler reads."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.passes.context import PassContext
from octavo.passes.registry import register_pass

aten = torch.ops.aten

# Ops that may sit between the lm_head linear and the graph output.
_PASS_THROUGH = {aten.select.int, aten.view.default, aten._to_copy.default, aten.slice.Tensor,
                 aten.squeeze.dim, aten.clone.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.tanh.default}
# Row-wise ops with a number as second operand (Gemma's final soft-cap: tanh(logits / cap) * cap).
_SCALAR_PASS_THROUGH = {aten.div.Tensor, aten.mul.Tensor}


@register_pass("prune_logits", "compute the lm_head only on the rows listed in logits_indices", required=True)
def prune_logits(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Insert `index_select(hidden, 1, logits_indices)` before the lm_head linear.

    The traced output is logits [T, V] for every token; afterwards it is
    logits [N, V] for the N token rows in the new runtime input
    `logits_indices` (int64 [N]), in that order. Everything before the
    lm_head still runs on all T tokens (the KV cache needs them). Between the
    lm_head and the output there may be views, casts and row-wise ops with a
    number operand (a final logit soft-cap), which then run on the N rows.
    """
    lm_head = _find_lm_head(graph_module)
    hidden = lm_head.args[0]
    shape = hidden.meta["val"].shape
    if len(shape) != 3 or shape[0] != 1:
        raise PassError(f"prune_logits: lm_head input {hidden.name} has shape {tuple(shape)}, expected [1, T, H]")
    indices = ctx.add_runtime_input(graph_module, "logits_indices", ["N"], torch.int64, role="logits_indices")
    with graph_module.graph.inserting_before(lm_head):
        pruned = graph_module.graph.call_function(aten.index_select.default, (hidden, 1, indices))
    lm_head.replace_input_with(hidden, pruned)
    ctx.stats["pruned_lm_head"] = lm_head.name
    return graph_module


def _find_lm_head(graph_module: GraphModule) -> Node:
    node = graph_module.graph.output_node().args[0]
    while isinstance(node, Node) and node.op == "call_function" and (
            node.target in _PASS_THROUGH
            or (node.target in _SCALAR_PASS_THROUGH and len(node.args) == 2 and isinstance(node.args[1], float))):
        node = node.args[0]
    if not (isinstance(node, Node) and node.target is aten.linear.default):
        raise PassError("prune_logits found no lm_head linear feeding the graph output")
    return node
