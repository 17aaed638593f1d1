"""fuse_activation: silu(gate) * up on the halves of a merged gate/up projection -> octavo.silu_and_mul."""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import erase_chain, is_call, only_user, split_operands
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo


@register_pass("fuse_activation", "replace silu(gate) * up over a merged gate/up projection by octavo.silu_and_mul")
def fuse_activation(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace `mul(silu(getitem(s, 0)), getitem(s, 1))` by `octavo.silu_and_mul(m)`.

    `s = aten.split_with_sizes(m, [I, I], -1)` must split `m` into exactly
    two equal halves (as fuse_gate_up leaves the merged projection), and the
    two getitems and the silu must be used only by this pattern; mul matches
    either operand order. The split and its getitems are erased with it.
    Runs after fuse_gate_up. Stats: silu_and_mul (matches), unmerged (gated
    activations whose gate and up are not halves of one split). Raises
    PassError when the graph has no gated SiLU at all, or has some but
    matched none while fuse_gate_up was enabled.
    """
    silus = find_nodes(graph_module, aten.silu.default)
    fused = sum(1 for silu in silus if _fuse(graph_module, silu))
    unmerged = sum(1 for silu in find_nodes(graph_module, aten.silu.default)
                   if is_call(only_user(silu), aten.mul.Tensor))
    if not silus:
        raise PassError("fuse_activation found no silu; every supported architecture "
                        f"({ctx.architecture.model_type}) has a gated SiLU MLP")
    if not fused and "fuse_gate_up" not in ctx.config.disabled_passes:
        raise PassError(f"fuse_activation matched none of {len(silus)} silu nodes: no silu(gate) * up over "
                        "the halves of a merged gate/up projection")
    ctx.stats.update({"silu_and_mul": fused, "unmerged": unmerged})
    return graph_module


def _fuse(graph_module: GraphModule, silu: Node) -> bool:
    gate, multiply = silu.args[0], only_user(silu)
    if not is_call(multiply, aten.mul.Tensor) or not _is_half(gate, 0) or len(gate.users) != 1:
        return False
    operands = split_operands(multiply, lambda arg: arg is silu)
    if operands is None:
        return False
    up = operands[1]
    if not _is_half(up, 1) or up.args[0] is not gate.args[0] or len(up.users) != 1:
        return False
    split = gate.args[0]
    with graph_module.graph.inserting_before(multiply):
        fused = graph_module.graph.call_function(octavo.silu_and_mul.default, (split.args[0],))
    fused.meta["val"] = multiply.meta.get("val")
    multiply.replace_all_uses_with(fused)
    erase_chain(graph_module, [split, gate, up, silu, multiply])
    return True


def _is_half(node, index: int) -> bool:
    """`node` is getitem `index` of a split_with_sizes into two equal halves of the last dim."""
    if not is_call(node, operator.getitem) or node.args[1] != index:
        return False
    split = node.args[0]
    if not is_call(split, aten.split_with_sizes.default) or len(split.args) != 3 or split.kwargs:
        return False
    sizes, dim = split.args[1], split.args[2]
    source = split.args[0].meta.get("val")
    last = dim == -1 or (source is not None and dim == source.dim() - 1)
    return last and len(sizes) == 2 and sizes[0] == sizes[1]
