"""fuse_qkv: the q, k and v projections of each attention -> one linear over concatenated weights."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.linear_merging import can_merge, merge_linears, mergeable_linear
from octavo.passes.pattern_utils import is_call
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo

# Ops that only re-view a tensor on the way from the v projection to paged_attention's value argument.
_VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
             aten.permute.default, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default)


@register_pass("fuse_qkv", "merge each attention's q, k and v projections into one linear plus a split")
def fuse_qkv(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Merge the projections that feed each octavo.paged_attention into one linear.

    For each paged_attention, the value argument is followed back through
    view-like ops (view, reshape, transpose, permute, select, ...) to its
    `aten.linear`; every linear reading that linear's input (q, k and v, in
    graph order) is merged by linear_merging.merge_linears: one linear over
    the row-concatenated weights (biases concatenated too, as Qwen2 has them),
    weight `..._qkv_proj_weight`, then `split_with_sizes([q, k, v], -1)`.
    The outputs equal the separate projections (bit for bit on the torch
    CPU backend, whose GEMM reduces each output element the same way).
    Runs after match_attention. Stats: merged_qkv (groups), merged_linears.
    Raises PassError when no attention's projections could be merged, unless the
    checkpoint already stores them merged (Architecture.fused_projections, Phi-3).
    """
    attentions = find_nodes(graph_module, octavo.paged_attention.default)
    if not attentions:
        raise PassError("fuse_qkv found no octavo.paged_attention node; it runs after match_attention")
    groups, linears = 0, 0
    for attention in attentions:
        group = _projection_group(attention, ctx)
        if group is None:
            continue
        merge_linears(graph_module, ctx, group, "qkv_proj")
        groups, linears = groups + 1, linears + len(group)
    if not groups and not ctx.architecture.fused_projections:
        raise PassError(f"fuse_qkv could not merge the projections of any of {len(attentions)} attention nodes")
    ctx.stats.update({"merged_qkv": groups, "merged_linears": linears})
    return graph_module


def _projection_group(attention: Node, ctx: PassContext) -> list[Node] | None:
    """The linears reading the input of the v projection (q, k, v in graph order), if they can merge."""
    value_projection = attention.args[2]
    while is_call(value_projection, *_VIEW_OPS):
        value_projection = value_projection.args[0]
    if not mergeable_linear(value_projection, ctx):
        return None
    hidden = value_projection.args[0]
    group = [user for user in hidden.users if mergeable_linear(user, ctx) and user.args[0] is hidden]
    order = {node: index for index, node in enumerate(hidden.graph.nodes)}
    group.sort(key=order.__getitem__)
    return group if len(group) >= 2 and can_merge(group) else None
