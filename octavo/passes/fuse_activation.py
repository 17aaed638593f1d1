"""fuse_activation: act(gate) * up on a merged gate/up projection -> octavo.silu_and_mul / gelu_and_mul."""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.fuse_gate_up import GATE_ACTIVATIONS
from octavo.passes.pattern_utils import erase_chain, is_call, only_user, split_operands
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo


@register_pass("fuse_activation", "replace silu(gate) * up or gelu(gate) * up over a merged gate/up projection "
               "by octavo.silu_and_mul / gelu_and_mul")
def fuse_activation(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace `mul(act(getitem(s, 0)), getitem(s, 1))` by `octavo.silu_and_mul(m)` or `gelu_and_mul(m, approx)`.

    `act` is aten.silu or aten.gelu (its `approximate` carried over). `s` must
    split `m` into exactly two equal halves of the last dim: the
    `aten.split_with_sizes(m, [I, I], -1)` fuse_gate_up leaves, or the
    `aten.split(m, I, -1)` a checkpoint's own merged gate_up projection is
    chunked with (Phi-3). The two getitems and the activation must be used
    only by this pattern; mul matches either operand order. The split and its
    getitems are erased with it. Runs after fuse_gate_up. Stats: silu_and_mul,
    gelu_and_mul (matches; the latter only when there are some), unmerged (gated activations whose gate and up are
    not halves of one split). Raises PassError when a dense-MLP model has no
    gated activation at all, or has some but matched none while fuse_gate_up
    was enabled.
    """
    activations = [node for target in GATE_ACTIVATIONS for node in find_nodes(graph_module, target)]
    fused = {"silu_and_mul": 0, "gelu_and_mul": 0}
    for activation in activations:
        kind = _fuse(graph_module, activation)
        if kind:
            fused[kind] += 1
    unmerged = sum(1 for target in GATE_ACTIVATIONS for node in find_nodes(graph_module, target)
                   if is_call(only_user(node), aten.mul.Tensor))
    if not activations and ctx.architecture.mlp == "dense":
        raise PassError("fuse_activation found no gated activation (silu or gelu); every dense architecture "
                        f"({ctx.architecture.model_type}) has a gated MLP")
    if activations and not sum(fused.values()) and "fuse_gate_up" not in ctx.config.disabled_passes:
        raise PassError(f"fuse_activation matched none of {len(activations)} activation nodes: no act(gate) * up "
                        "over the halves of a merged gate/up projection")
    gelu = {"gelu_and_mul": fused["gelu_and_mul"]} if fused["gelu_and_mul"] else {}
    ctx.stats.update({"silu_and_mul": fused["silu_and_mul"], **gelu, "unmerged": unmerged})
    return graph_module


def _fuse(graph_module: GraphModule, activation: Node) -> str | None:
    gate, multiply = activation.args[0], only_user(activation)
    if not is_call(multiply, aten.mul.Tensor) or not _is_half(gate, 0) or len(gate.users) != 1:
        return None
    operands = split_operands(multiply, lambda arg: arg is activation)
    if operands is None:
        return None
    up = operands[1]
    if not _is_half(up, 1) or up.args[0] is not gate.args[0] or len(up.users) != 1:
        return None
    split = gate.args[0]
    if activation.target is aten.silu.default:
        kind, target, arguments = "silu_and_mul", octavo.silu_and_mul.default, (split.args[0],)
    else:
        approximate = activation.kwargs.get("approximate", activation.args[1] if len(activation.args) > 1 else "none")
        kind, target, arguments = "gelu_and_mul", octavo.gelu_and_mul.default, (split.args[0], approximate)
    with graph_module.graph.inserting_before(multiply):
        fused = graph_module.graph.call_function(target, arguments)
    fused.meta["val"] = multiply.meta.get("val")
    multiply.replace_all_uses_with(fused)
    erase_chain(graph_module, [split, gate, up, activation, multiply])
    return kind


def _is_half(node, index: int) -> bool:
    """`node` is getitem `index` of a split of the last dim into two equal halves."""
    if not is_call(node, operator.getitem) or node.args[1] != index:
        return False
    split = node.args[0]
    source = split.args[0].meta.get("val") if isinstance(split, Node) and split.args else None
    if source is None or split.kwargs or len(split.args) != 3:
        return False
    size, dim = split.args[1], split.args[2]
    if dim not in (-1, source.dim() - 1) or not isinstance(source.shape[-1], int):
        return False
    if is_call(split, aten.split_with_sizes.default):
        return len(size) == 2 and size[0] == size[1]
    return is_call(split, aten.split.Tensor) and isinstance(size, int) and 2 * size == source.shape[-1]
