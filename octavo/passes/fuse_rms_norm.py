"""fuse_rms_norm: the decomposed RMSNorm transformers traces to -> octavo.rms_norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import (
    erase_chain,
    is_call,
    is_float_cast,
    is_weight,
    only_user,
    split_operands,
    tensor_value,
)
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo


@dataclass
class RmsNormMatch:
    """One matched RMSNorm: input x, weight, eps, the node whose uses it replaces, the nodes it removes.

    multiply_in_float32: the weight multiplies the float32 value before the cast back (Gemma, OLMo 2);
    weight_offset: the weight the model multiplies by is ``offset + weight`` (Gemma's ``1 + w``).
    """

    x: Node
    weight: Node
    eps: float
    output: Node
    nodes: list[Node]
    multiply_in_float32: bool = False
    weight_offset: float = 0.0


@register_pass("fuse_rms_norm", "replace each decomposed RMSNorm (pow, mean, add eps, rsqrt, mul, weight) "
               "by octavo.rms_norm")
def fuse_rms_norm(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace every decomposed LlamaRMSNorm by one `octavo.rms_norm(x, weight, eps)`.

    The pattern, anchored at each `aten.mean.dim`, is (casts present only
    when x is not float32; `*` matches either operand order):
    `h = x.to(f32); r = rsqrt(mean(h ** 2, [-1], keepdim=True) + eps);
    out = weight * (h * r).to(x.dtype)`, with `weight` a weight placeholder of
    shape [H] and every intermediate used only inside the pattern (the cast h
    may have other users; it then stays). Uses of `out` are redirected to the
    new node; the pattern's nodes are erased. This covers the decoder norms,
    the final norm and Qwen3's per-head q/k norms (x [1, T, heads, head_dim]).

    The float32-multiply form (Gemma, OLMo 2) is `out = (h * r * w32).to(x.dtype)`
    with `w32` the weight (cast to float32 when it is not) or `1.0 + w` (Gemma),
    and the cast back a `_to_copy` or `type_as(., x)` (absent in float32). It
    becomes `octavo.rms_norm(x, w', eps, multiply_in_float32=True)`, where `w'`
    is the weight or, for `1.0 + w`, a new float32 weight `<weight>_plus_1`
    holding `w.float() + 1.0` (what the model computes at every call).
    Stats: rms_norms (matches); float32_multiply, offset_weights, unused_weights
    when not zero. Raises
    PassError when nothing matches, since every supported architecture
    normalizes with RMSNorm.
    """
    matches = [match for mean in find_nodes(graph_module, aten.mean.dim)
               if (match := match_rms_norm(mean, ctx)) is not None]
    if not matches:
        raise PassError("fuse_rms_norm found no RMSNorm pattern (pow, mean, add eps, rsqrt, mul, weight); "
                        f"every supported architecture ({ctx.architecture.model_type}) has one")
    offset_weights: dict[tuple[str, float], Node] = {}
    for match in matches:
        weight = match.weight
        if match.weight_offset:
            key = (weight.name, match.weight_offset)
            if key not in offset_weights:
                value = ctx.weights[weight.name].float() + match.weight_offset
                offset_weights[key] = ctx.add_weight(graph_module, f"{weight.name}_plus_1", value)
            weight = offset_weights[key]
        flag = (True,) if match.multiply_in_float32 else ()
        with graph_module.graph.inserting_before(match.output):
            fused = graph_module.graph.call_function(octavo.rms_norm.default, (match.x, weight, match.eps, *flag))
        fused.meta["val"] = match.output.meta.get("val")
        match.output.replace_all_uses_with(fused)
        erase_chain(graph_module, match.nodes)
    extra = {"float32_multiply": sum(match.multiply_in_float32 for match in matches),
             "offset_weights": len(offset_weights), "unused_weights": ctx.remove_unused_weights(graph_module)}
    ctx.stats.update({"rms_norms": len(matches), **{key: value for key, value in extra.items() if value}})
    return graph_module


def match_rms_norm(mean: Node, ctx: PassContext) -> RmsNormMatch | None:
    """The RMSNorm around `mean` (see fuse_rms_norm), or None when `mean` is not part of one."""
    core = _match_variance_scaling(mean)
    if core is None:
        return None
    hidden, chain = core
    x = hidden.args[0] if is_float_cast(hidden, torch.float32) else hidden
    x_value, hidden_value = tensor_value(x), tensor_value(hidden)
    if x_value is None or hidden_value is None or hidden_value.dtype != torch.float32:
        return None
    removed = [hidden] if hidden is not x else []
    eps = float(chain[2].args[1])
    float32_form = _match_float32_multiply(chain[-1], x, x_value, ctx)
    if float32_form is not None:
        weight, offset, nodes, output = float32_form
        return RmsNormMatch(x, weight, eps, output, [*removed, *chain, *nodes], True, offset)
    normalized, casts = chain[-1], []
    if x_value.dtype != torch.float32:  # HF casts back to the input dtype before the weight multiply
        cast_back = only_user(normalized)
        if not is_float_cast(cast_back, x_value.dtype):
            return None
        normalized, casts = cast_back, [cast_back]
    output = only_user(normalized)
    operands = split_operands(output, lambda arg: arg is normalized) if is_call(output, aten.mul.Tensor) else None
    if operands is None or not _is_norm_weight(operands[1], x_value, ctx):
        return None
    return RmsNormMatch(x, operands[1], eps, output, [*removed, *chain, *casts, output])


def _match_float32_multiply(normalized: Node, x: Node, x_value: torch.Tensor,
                            ctx: PassContext) -> tuple[Node, float, list[Node], Node] | None:
    """(weight, offset, nodes, output) of `(normalized * w32).to(x.dtype)` (see fuse_rms_norm), or None."""
    multiply = only_user(normalized)
    if not is_call(multiply, aten.mul.Tensor):
        return None
    operands = split_operands(multiply, lambda arg: arg is normalized)
    if operands is None:
        return None
    weight, offset, weight_nodes = _float32_weight(operands[1])
    if not _is_norm_weight(weight, x_value, ctx) or (x_value.dtype == torch.float32 and not offset
                                                     and not _is_cast_back(only_user(multiply), x)):
        return None  # float32 Llama norms without a cast back: the ordinary form
    output, casts = multiply, []
    cast_back = only_user(multiply)
    if _is_cast_back(cast_back, x):
        output, casts = cast_back, [cast_back]
    elif x_value.dtype != torch.float32:
        return None
    return weight, offset, [*weight_nodes, multiply, *casts], output


def _float32_weight(node) -> tuple[Node, float, list[Node]]:
    """(weight, offset, the nodes between) for `w`, `w.float()`, `1.0 + w` or `1.0 + w.float()`."""
    offset, nodes = 0.0, []
    if is_call(node, aten.add.Tensor) and len(node.args) == 2 and type(node.args[1]) is float and len(node.users) == 1:
        offset, nodes, node = node.args[1], [node], node.args[0]
    if is_float_cast(node, torch.float32) and len(node.users) == 1:
        nodes, node = [node, *nodes], node.args[0]
    return node, offset, nodes


def _is_cast_back(node, x: Node) -> bool:
    """`node` casts to x's dtype: `_to_copy(dtype=x.dtype)` or `type_as(., x)`."""
    if is_call(node, aten.type_as.default):
        return node.args[1] is x or tensor_value(node).dtype == tensor_value(x).dtype
    return is_float_cast(node, tensor_value(x).dtype)


def _match_variance_scaling(mean: Node) -> tuple[Node, list[Node]] | None:
    """`h * rsqrt(mean(h ** 2, [-1], True) + eps)` around `mean`: (h, [pow, mean, add, rsqrt, mul])."""
    square = mean.args[0]
    if len(mean.args) != 3 or mean.kwargs or mean.args[2] is not True or not _is_last_dim(mean):
        return None
    if not is_call(square, aten.pow.Tensor_Scalar) or square.args[1] not in (2, 2.0) or len(square.users) != 1:
        return None
    add_eps = only_user(mean)
    if not (is_call(add_eps, aten.add.Tensor) and add_eps.args[0] is mean and type(add_eps.args[1]) is float):
        return None
    rsqrt = only_user(add_eps)
    scaled = only_user(rsqrt) if is_call(rsqrt, aten.rsqrt.default) else None
    if not is_call(scaled, aten.mul.Tensor):
        return None
    operands = split_operands(scaled, lambda arg: arg is rsqrt)
    hidden = square.args[0]
    if operands is None or operands[1] is not hidden:
        return None
    return hidden, [square, mean, add_eps, rsqrt, scaled]


def _is_last_dim(mean: Node) -> bool:
    value = tensor_value(mean.args[0])
    dims = mean.args[1]
    return value is not None and isinstance(dims, list) and len(dims) == 1 and dims[0] in (-1, value.dim() - 1)


def _is_norm_weight(node, x_value: torch.Tensor, ctx: PassContext) -> bool:
    weight = tensor_value(node)
    return (is_weight(node, ctx) and weight is not None and weight.dim() == 1
            and weight.shape[0] == x_value.shape[-1])
