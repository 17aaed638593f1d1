"""match_moe: transformers' sparse MoE block (router + routed experts) -> octavo.moe.

The frontend traces mixtures of experts with transformers' batched_mm experts (the
eager ones loop over the experts a batch hit, which torch.export cannot trace). One
block then reads, for router logits ``r = linear(x, W_router)`` [T, E] (x, or a view
of it, without bias):

    p = softmax(r (as float32), -1); values, experts = topk(p, k)
    [values = values / values.sum(-1, keepdim=True)]      (norm_topk_prob, Mixtral)
    [values = values.to(x.dtype)]                          (all but Mixtral)
    ids = experts.view(-1) [.clamp(0, E - 1)]; w = values.view(-1)
    h = bmm(W_gate_up[ids], repeat_interleave(x, k, 0).unsqueeze(-1)).squeeze(-1)
    g, u = h.split(I, -1); h = act(g) * u
    o = bmm(W_down[ids], h.unsqueeze(-1)).squeeze(-1) * w.unsqueeze(-1)
    out = o.view(T, k, H).sum(1) [.to(x.dtype)]

which is octavo.moe's definition with the router weight [E, H] and the experts' stacked
weights [E, 2I, H] and [E, H, I] as they are. The match is structural: each node above is checked (op, operand,
axis); anything else around a topk is a PassError naming the node, since an unmatched
block would run every token through gathered copies of its experts' weights.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.canonicalize import eliminate_dead_nodes
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, is_float_cast, is_weight, only_user, split_operands, tensor_value
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_ACTIVATIONS = {aten.silu.default: "silu", aten.gelu.default: "gelu"}


@dataclass
class MoeBlock:
    """One matched block: octavo.moe's arguments and the node whose uses it takes over."""

    x: Node
    router_weight: Node
    gate_up: Node
    down: Node
    top_k: int
    normalize: bool
    activation: str
    round_weights: bool
    output: Node


@register_pass("match_moe", "replace each sparse MoE block (softmax-top-k router + batched experts) by octavo.moe",
               required=True)
def match_moe(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Rewrite every sparse MoE block (see the module docstring) into `octavo.moe`.

    Stats: moe_blocks, experts (per block), top_k, normalized (blocks that renormalize their
    top-k weights). A dense architecture has no topk and nothing happens; a mixture-of-experts
    architecture (Architecture.mlp "moe") with no block matched is a PassError.
    """
    topks = find_nodes(graph_module, aten.topk.default)
    blocks = [match_moe_block(topk, ctx) for topk in topks]
    if not blocks and ctx.architecture is not None and ctx.architecture.mlp == "moe":
        raise PassError(f"match_moe found no top-k router in a mixture-of-experts model "
                        f"({ctx.architecture.model_type})")
    for block in blocks:
        _replace(graph_module, block)
    ctx.stats.update({"moe_blocks": len(blocks), "dead_nodes": eliminate_dead_nodes(graph_module)})
    if blocks:
        ctx.stats.update({"experts": int(tensor_value(blocks[0].gate_up).shape[0]), "top_k": blocks[0].top_k,
                          "normalized": sum(block.normalize for block in blocks),
                          "activation": blocks[0].activation})
    return graph_module


def _replace(graph_module: GraphModule, block: MoeBlock) -> None:
    with graph_module.graph.inserting_before(block.output):
        moe = graph_module.graph.call_function(octavo.moe.default, (
            block.x, block.router_weight, block.gate_up, block.down, block.top_k, block.normalize,
            block.activation, block.round_weights))
    moe.meta["val"] = block.output.meta.get("val")
    block.output.replace_all_uses_with(moe)


def match_moe_block(topk: Node, ctx: PassContext) -> MoeBlock:
    """The MoE block around router `topk`, or PassError naming what did not fit."""
    softmax = topk.args[0]
    if not is_call(softmax, aten.softmax.int, aten._softmax.default) or softmax.args[1] not in (-1, 1):
        raise _unmatched(topk, "its input is not a softmax over the experts")
    router_logits = softmax.args[0].args[0] if is_float_cast(softmax.args[0], torch.float32) else softmax.args[0]
    if not (is_call(router_logits, aten.linear.default) and len(router_logits.args) == 2
            and is_weight(router_logits.args[1], ctx)):
        raise _unmatched(topk, "its logits are not a linear of the hidden states without bias")
    values, experts = _getitems(topk)
    weights, normalize, cast = _routing_weights(values, topk)
    ids = _single_view_user(experts, topk)
    clamp = only_user(ids)
    if is_call(clamp, aten.clamp.default) and clamp.args[1] == 0:  # some releases clamp the (in-range) ids
        ids = clamp
    gathers = [user for user in ids.users if is_call(user, aten.index.Tensor)]
    if len(gathers) != 2 or any(not is_weight(gather.args[0], ctx) for gather in gathers):
        raise _unmatched(topk, "its expert ids do not gather exactly two stacked weights")
    order = {node: index for index, node in enumerate(topk.graph.nodes)}
    # The gate/up projection is the first of the two in graph order, the down projection the second.
    (first_bmm, gate_up), (second_bmm, down) = sorted(((_bmm_of(gather, topk), gather) for gather in gathers),
                                                      key=lambda pair: order[pair[0]])
    x = _repeated_input(first_bmm, topk)
    activation = _activation(second_bmm, first_bmm, topk)
    output = _weighted_sum(second_bmm, weights, topk)
    dtype = tensor_value(x).dtype
    if tensor_value(output).dtype != dtype:
        raise _unmatched(topk, f"its result is {tensor_value(output).dtype}, not the input's {dtype}")
    if not _same_rows(router_logits.args[0], x):
        raise _unmatched(topk, "the router and the experts read different inputs")
    return MoeBlock(x, router_logits.args[1], gate_up.args[0], down.args[0], int(topk.args[1]), normalize,
                    activation, cast or dtype == torch.float32, output)


def _same_rows(node: Node, x: Node) -> bool:
    """`node` is `x` or a view of it with the same [T, H] shape."""
    while is_call(node, *_VIEWS) and node is not x:
        node = node.args[0]
    return node is x


def _unmatched(topk: Node, reason: str) -> PassError:
    return PassError(f"match_moe: the router top-k {topk.name} is not a supported MoE block: {reason}")


def _getitems(topk: Node) -> tuple[Node, Node]:
    items = {user.args[1]: user for user in topk.users if is_call(user, operator.getitem)}
    if set(items) != {0, 1}:
        raise _unmatched(topk, "its values and indices are not both used")
    return items[0], items[1]


def _routing_weights(values: Node, topk: Node) -> tuple[Node, bool, bool]:
    """(the flattened weights node, normalized, cast to the model dtype)."""
    node, normalize, cast = values, False, False
    if len(node.users) == 2:  # values / values.sum(-1, keepdim=True)
        total = next((user for user in node.users if is_call(user, aten.sum.dim_IntList)), None)
        divide = next((user for user in node.users if is_call(user, aten.div.Tensor)), None)
        if total is None or divide is None or tuple(divide.args) != (node, total):
            raise _unmatched(topk, "its top-k values have readers other than their normalization")
        node, normalize = divide, True
    user = only_user(node)
    if is_float_cast(user):
        node, cast = user, True
    return _single_view_user(node, topk), normalize, cast


def _single_view_user(node: Node, topk: Node) -> Node:
    view = only_user(node)
    if not is_call(view, *_VIEWS) or list(view.args[1]) != [-1]:
        raise _unmatched(topk, f"{node.name} is not flattened for the experts")
    return view


def _bmm_of(gather: Node, topk: Node) -> Node:
    bmm = only_user(gather)
    if not is_call(bmm, aten.bmm.default) or bmm.args[0] is not gather or tensor_value(gather.args[0]).dim() != 3:
        raise _unmatched(topk, f"the gathered weight {gather.args[0].name} does not multiply its rows")
    return bmm


def _column_input(bmm: Node, topk: Node) -> Node:
    """v when bmm's second operand is v.unsqueeze(-1)."""
    column = bmm.args[1]
    if not is_call(column, aten.unsqueeze.default) or column.args[1] not in (-1, 2):
        raise _unmatched(topk, f"{bmm.name} does not multiply one row per token-expert pair")
    return column.args[0]


def _repeated_input(bmm: Node, topk: Node) -> Node:
    repeated = _column_input(bmm, topk)
    if not is_call(repeated, aten.repeat_interleave.self_int) or repeated.args[1:3] != (topk.args[1], 0):
        raise _unmatched(topk, "the experts' input is not each token repeated top_k times")
    return repeated.args[0]


def _activation(second_bmm: Node, first_bmm: Node, topk: Node) -> str:
    """The gated activation between the two expert projections: act(g) * u on the halves of the first."""
    product = _column_input(second_bmm, topk)
    squeezed = only_user(first_bmm)
    split = only_user(squeezed) if is_call(squeezed, aten.squeeze.dim) else None
    if not is_call(product, aten.mul.Tensor) or not is_call(split, aten.split.Tensor, aten.split_with_sizes.default):
        raise _unmatched(topk, "the experts are not act(gate) * up over the halves of one projection")
    operands = split_operands(product, lambda arg: is_call(arg, *_ACTIVATIONS))
    if operands is None:
        raise _unmatched(topk, "the experts' gate has no silu or gelu")
    activated, up = operands
    gate = activated.args[0]
    halves = {node.args[1]: node for node in (gate, up) if is_call(node, operator.getitem) and node.args[0] is split}
    if set(halves) != {0, 1} or halves[0] is not gate:
        raise _unmatched(topk, "the experts' gate and up are not the first and second halves of their projection")
    kind = _ACTIVATIONS[activated.target]
    if kind == "gelu" and activated.kwargs.get("approximate", "none") == "tanh":
        kind = "gelu_tanh"
    return kind


def _weighted_sum(second_bmm: Node, weights: Node, topk: Node) -> Node:
    """The block's result: squeeze, times the routing weights, view [T, k, H], sum over k, optional cast."""
    squeezed = only_user(second_bmm)
    weighted = only_user(squeezed) if is_call(squeezed, aten.squeeze.dim) else None
    if not is_call(weighted, aten.mul.Tensor):
        raise _unmatched(topk, "the experts' outputs are not multiplied by the routing weights")
    operands = split_operands(weighted, lambda arg: arg is squeezed)
    column = operands[1] if operands else None
    if not (is_call(column, aten.unsqueeze.default) and column.args[0] is weights):
        raise _unmatched(topk, "the experts' outputs are multiplied by something other than the routing weights")
    view = only_user(weighted)
    total = only_user(view) if is_call(view, *_VIEWS) else None
    if not is_call(total, aten.sum.dim_IntList) or list(total.args[1]) != [1]:
        raise _unmatched(topk, "the weighted outputs are not summed over each token's experts")
    cast = only_user(total)
    return cast if is_float_cast(cast) else total
