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
    """One matched RMSNorm: input x, weight, eps, the node whose uses it replaces, the nodes it removes."""

    x: Node
    weight: Node
    eps: float
    output: Node
    nodes: list[Node]


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
    Stats: rms_norms (matches). Raises PassError when nothing matches, since
    every supported architecture normalizes with RMSNorm.
    """
    matches = [match for mean in find_nodes(graph_module, aten.mean.dim)
               if (match := match_rms_norm(mean, ctx)) is not None]
    if not matches:
        raise PassError("fuse_rms_norm found no RMSNorm pattern (pow, mean, add eps, rsqrt, mul, weight); "
                        f"every supported architecture ({ctx.architecture.model_type}) has one")
    for match in matches:
        with graph_module.graph.inserting_before(match.output):
            fused = graph_module.graph.call_function(octavo.rms_norm.default, (match.x, match.weight, match.eps))
        fused.meta["val"] = match.output.meta.get("val")
        match.output.replace_all_uses_with(fused)
        erase_chain(graph_module, match.nodes)
    ctx.stats["rms_norms"] = len(matches)
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
    removed = [hidden] if hidden is not x else []
    eps = float(chain[2].args[1])
    return RmsNormMatch(x, operands[1], eps, output, [*removed, *chain, *casts, output])


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
