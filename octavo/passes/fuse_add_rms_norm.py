"""fuse_add_rms_norm: residual add + the RMSNorm that reads it -> octavo.fused_add_rms_norm."""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, same_shape, tensor_value
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo


@register_pass("fuse_add_rms_norm", "fuse each residual add with the octavo.rms_norm that reads it into "
               "octavo.fused_add_rms_norm (normed output, new residual)")
def fuse_add_rms_norm(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace `s = add(a, b); n = octavo.rms_norm(s, w, eps)` by one `octavo.fused_add_rms_norm(b, a, w, eps)`.

    `a` and `b` must be tensors of one shape and dtype (no broadcasting, no
    alpha). The fused op computes `a + b` in that operand order (it is
    `residual + x` with residual = a, x = b) and returns (normed, sum): uses
    of `n` read result 0, every other use of `s` (the next residual add, in
    the next layer or after the attention) reads result 1. So in a decoder
    the add before each layer's post-attention norm, the add that ends each
    layer (read by the next layer's input norm, across the layer boundary)
    and the last add (read by the final norm) are fused; the model's very
    first norm, which reads the embedding, stays an rms_norm.

    Runs after fuse_rms_norm. Stats: fused_add_rms_norms (matches),
    rms_norms_left (norms with no add to fuse). Raises PassError when the graph
    has rms_norm nodes but none follows an add; when it has none at all
    because fuse_rms_norm was disabled, records `skipped` instead.
    """
    norms = find_nodes(graph_module, octavo.rms_norm.default)
    if not norms:
        _nothing_to_fuse(ctx)
        return graph_module
    fused = 0
    for norm in norms:
        if _fuse(graph_module, norm):
            fused += 1
    if not fused:
        raise PassError(f"fuse_add_rms_norm found {len(norms)} rms_norm nodes but none reads a residual add")
    ctx.stats.update({"fused_add_rms_norms": fused, "rms_norms_left": len(norms) - fused})
    return graph_module


def _nothing_to_fuse(ctx: PassContext) -> None:
    if "fuse_rms_norm" not in ctx.config.disabled_passes:
        raise PassError("fuse_add_rms_norm found no octavo.rms_norm node; it runs after fuse_rms_norm")
    ctx.stats["skipped"] = "fuse_rms_norm is disabled"


def _fuse(graph_module: GraphModule, norm: Node) -> bool:
    """Fuse `norm` with the add it reads, when that is a same-shape, same-dtype residual add."""
    add = norm.args[0]
    if not is_call(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2:
        return False
    residual, x = add.args
    values = [tensor_value(node) for node in (residual, x, add)]
    if any(value is None for value in values) or len({value.dtype for value in values}) != 1:
        return False
    if not (same_shape(values[0], values[1]) and same_shape(values[0], values[2])):
        return False
    graph = graph_module.graph
    _, weight, eps, *multiply_in_float32 = norm.args
    # Right after the add: the add's other users all come later, and its operands come earlier.
    with graph.inserting_after(add):
        fused = graph.call_function(octavo.fused_add_rms_norm.default,
                                    (x, residual, weight, eps, *multiply_in_float32))
    with graph.inserting_after(fused):
        normed = graph.call_function(operator.getitem, (fused, 0))
    with graph.inserting_after(normed):
        new_residual = graph.call_function(operator.getitem, (normed.args[0], 1))
    # Later matches of this pass read these values (the add of the next layer reads new_residual).
    normed.meta["val"], new_residual.meta["val"] = norm.meta.get("val"), add.meta.get("val")
    fused.meta["val"] = (normed.meta["val"], new_residual.meta["val"])
    norm.replace_all_uses_with(normed)
    graph.erase_node(norm)
    add.replace_all_uses_with(new_residual)
    graph.erase_node(add)
    return True
