"""narrow_weights: store the matrix weights of a float32 artifact in 16 bits, widened where they are read."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, is_weight
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo


@register_pass("narrow_weights", "store linear and embedding weights in --weight-dtype: aten.linear -> "
                                 "octavo.linear_w16 (float32 compute)", required=True)
def narrow_weights(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Round every linear's weight (lm_head included) and every embedding table to ctx.config.weight_dtype.

    Applies when the artifact computes in float32 and ctx.config.weight_dtype is bfloat16 or
    float16 (otherwise it changes nothing); the default pipeline runs it last, for exactly
    those configs (an optional pass), and it cannot be disabled (the manifest's weight dtype
    depends on it). Each weight placeholder read by an aten.linear or
    an aten.embedding gets its tensor rounded (round to nearest even) to that dtype; then
    - ``aten.linear(x, w[, b])`` becomes ``octavo.linear_w16(x, w[, b])`` (the bias stays float32),
      which computes x @ w.float().T + b in float32;
    - ``aten.embedding(w, ids)`` is followed by ``aten._to_copy(dtype=float32)`` of the gathered
      rows (a tied embedding reads the same narrowed tensor as the lm_head);
    - any other reader gets ``aten._to_copy(w, dtype=float32)``.
    Widening is exact, so the artifact computes the float32 model over the rounded weights.
    Stats: weight_dtype, linears, embeddings, weights, bytes_saved. Raises PassError when asked to
    narrow but no linear reads a weight, or when the artifact does not compute in float32.
    """
    target = ctx.config.weight_dtype
    if target is None or target == ctx.config.dtype:
        ctx.stats.update(weight_dtype=ctx.config.dtype, linears=0)
        return graph_module
    if ctx.config.dtype != "float32":
        raise PassError(f"narrow_weights: --weight-dtype {target} needs a float32 artifact, this one is "
                        f"{ctx.config.dtype}")
    dtype = getattr(torch, target)
    readers = {aten.linear.default: 1, aten.embedding.default: 0}  # op -> position of its weight argument
    weights = {node.args[position] for op, position in readers.items() for node in find_nodes(graph_module, op)
               if is_weight(node.args[position], ctx) and ctx.weights[node.args[position].name].dim() == 2}
    if not any(is_call(user, aten.linear.default) for weight in weights for user in weight.users):
        raise PassError("narrow_weights found no aten.linear reading a weight")
    counts = {"linears": 0, "embeddings": 0}
    saved = 0
    for weight in sorted(weights, key=lambda node: node.name):
        saved += _narrow(weight, dtype, ctx)
        for user in list(weight.users):
            _widen_for(graph_module, user, weight, counts)
    ctx.stats.update(weight_dtype=target, **counts, weights=len(weights), bytes_saved=saved)
    return graph_module


def _narrow(weight: Node, dtype: torch.dtype, ctx: PassContext) -> int:
    """Round the placeholder's tensor to `dtype` in ctx.weights and in its meta; returns the bytes saved."""
    tensor = ctx.weights[weight.name]
    narrowed = tensor.to(dtype)
    ctx.weights[weight.name] = narrowed
    with ctx.fake_mode:
        weight.meta["val"] = torch.empty(tensor.shape, dtype=dtype)
    return tensor.numel() * (tensor.element_size() - narrowed.element_size())


def _widen_for(graph_module: GraphModule, user: Node, weight: Node, counts: dict) -> None:
    graph = graph_module.graph
    if is_call(user, aten.linear.default) and user.args[1] is weight and not user.kwargs:
        bias = user.args[2] if len(user.args) > 2 else None
        with graph.inserting_before(user):
            replacement = graph.call_function(octavo.linear_w16.default, (user.args[0], weight, bias))
        replacement.meta.update(user.meta)
        user.replace_all_uses_with(replacement)
        graph.erase_node(user)
        counts["linears"] += 1
    elif is_call(user, aten.embedding.default) and user.args[0] is weight:
        with graph.inserting_after(user):
            widened = graph.call_function(aten._to_copy.default, (user,), {"dtype": torch.float32})
        user.replace_all_uses_with(widened, delete_user_cb=lambda node: node is not widened)
        counts["embeddings"] += 1
    else:
        with graph.inserting_before(user):
            widened = graph.call_function(aten._to_copy.default, (weight,), {"dtype": torch.float32})
        user.replace_input_with(weight, widened)
