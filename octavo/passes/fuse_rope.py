"""fuse_rope: rotate_half RoPE on q and k -> octavo.rotary_embedding over a compile-time cos/sin cache."""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.ir.graph_inputs import INPUT_IDS, POSITIONS
from octavo.passes.canonicalize import eliminate_dead_nodes
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, placeholder_named, split_operands, tensor_value
from octavo.passes.registry import register_pass
from octavo.passes.subgraph_evaluation import ancestors, evaluate_subgraph

aten = torch.ops.aten
octavo = torch.ops.octavo
CACHE_NAME = "rotary_cos_sin_cache"


@dataclass
class RopeApplication:
    """`output = x * unsqueeze(cos, 1) + rotate_half(x) * unsqueeze(sin, 1)` found in the graph."""

    x: Node
    cos: Node
    sin: Node
    output: Node


@register_pass("fuse_rope", "replace rotate_half RoPE on q and k by octavo.rotary_embedding over a "
               "precomputed cos/sin cache")
def fuse_rope(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Replace each layer's RoPE on q and k by one `octavo.rotary_embedding(q, k, positions, cache)`.

    A RoPE application is `add(mul(x, cos_u), mul(cat([neg(x[..., D/2:]),
    x[..., :D/2]], -1), sin_u))` (operands of add and mul in either order)
    with x [1, H, T, D], cos_u = unsqueeze(cos, 1), sin_u = unsqueeze(sin, 1)
    and cos/sin [1, T, D] computed from `positions` and weights only.
    Applications sharing one cos/sin pair are paired in graph order
    (q then k of each layer); each pair becomes one rotary_embedding whose
    results replace the two adds. The cache input (weight
    `rotary_cos_sin_cache`, [max_position_embeddings, 2, D] in cos's dtype)
    holds the traced cos/sin subgraph evaluated once at compile time for
    positions 0..max_position_embeddings-1, so every rope scaling the model
    uses is reproduced exactly; that subgraph, now dead, is removed, along
    with weights it alone read (inv_freq). Stats: rotary_embeddings (pairs),
    unpaired (applications left alone), cache_positions. Raises PassError
    when nothing matches, since every supported architecture uses this RoPE.
    """
    applications = [match for add in find_nodes(graph_module, aten.add.Tensor)
                    if (match := match_rope(add)) is not None]
    by_table: dict[tuple[Node, Node], list[RopeApplication]] = defaultdict(list)
    for application in applications:
        by_table[(application.cos, application.sin)].append(application)
    positions = placeholder_named(graph_module, POSITIONS)
    fused = 0
    for index, ((cos, sin), group) in enumerate(by_table.items()):
        cache = _add_cache(graph_module, ctx, cos, sin, positions, index)
        fused += sum(_fuse_pair(graph_module, pair, positions, cache) for pair in _pairs(group))
    if not fused:
        raise PassError(f"fuse_rope found no rotate_half RoPE on q and k ({len(applications)} single "
                        f"applications); every supported architecture ({ctx.architecture.model_type}) uses it")
    ctx.stats.update({"rotary_embeddings": fused, "unpaired": len(applications) - 2 * fused,
                      "cache_positions": _num_positions(ctx), "dead_nodes": eliminate_dead_nodes(graph_module),
                      "unused_weights": ctx.remove_unused_weights(graph_module)})
    return graph_module


def match_rope(add: Node) -> RopeApplication | None:
    """The RoPE application whose final add is `add` (see fuse_rope), or None."""
    if len(add.args) != 2 or add.kwargs:
        return None
    for direct, rotated in (add.args, reversed(add.args)):
        if not (is_call(direct, aten.mul.Tensor) and is_call(rotated, aten.mul.Tensor)):
            continue
        found = split_operands(rotated, lambda arg: _rotate_half_source(arg) is not None)
        if found is None:
            continue
        x, sin_u = _rotate_half_source(found[0]), found[1]
        cos_operand = split_operands(direct, lambda arg, x=x: arg is x)
        if cos_operand is None:
            continue
        cos, sin = _table(cos_operand[1]), _table(sin_u)
        if cos is not None and sin is not None and _fits(x, cos):
            return RopeApplication(x, cos, sin, add)
    return None


def _rotate_half_source(node) -> Node | None:
    """x when `node` is cat([neg(x[..., D/2:]), x[..., :D/2]], -1), else None."""
    if not is_call(node, aten.cat.default) or len(node.args) != 2 or len(node.args[0]) != 2:
        return None
    (negated, first_half), dim = node.args
    if not is_call(negated, aten.neg.default) or not is_call(first_half, aten.slice.Tensor):
        return None
    second_half = negated.args[0]
    x = first_half.args[0]
    value = tensor_value(x)
    if value is None or not is_call(second_half, aten.slice.Tensor) or second_half.args[0] is not x:
        return None
    last, size = value.dim() - 1, value.shape[-1]
    if dim not in (-1, last) or not isinstance(size, int) or size % 2:
        return None
    if _slice_bounds(first_half, last) != (0, size // 2) or _slice_bounds(second_half, last) != (size // 2, size):
        return None
    return x


def _slice_bounds(node: Node, last: int) -> tuple[int, int] | None:
    """(start, end clipped to the dim size) of a last-dim slice with step 1 and int bounds."""
    args = list(node.args) + [None] * (5 - len(node.args))
    _, dim, start, end, step = args[:5]
    size = tensor_value(node.args[0]).shape[-1]
    if dim not in (-1, last) or step not in (None, 1) or not isinstance(start, int) or not isinstance(end, int):
        return None
    return start, min(end, size)


def _table(node) -> Node | None:
    """cos (or sin) [1, T, D] when `node` is unsqueeze(cos, 1)."""
    if not is_call(node, aten.unsqueeze.default) or node.args[1] != 1:
        return None
    table = node.args[0]
    value = tensor_value(table)
    return table if value is not None and value.dim() == 3 else None


def _fits(x: Node, cos: Node) -> bool:
    """x [1, H, T, D] against cos [1, T, D]: same head dim, one batch row."""
    x_value, cos_value = tensor_value(x), tensor_value(cos)
    return (x_value.dim() == 4 and x_value.shape[0] == 1 and cos_value.shape[0] == 1
            and x_value.shape[-1] == cos_value.shape[-1])


def _pairs(group: list[RopeApplication]) -> list[tuple[RopeApplication, RopeApplication]]:
    """Consecutive applications in graph order: (q, k) of each layer."""
    order = {node: index for index, node in enumerate(group[0].output.graph.nodes)}
    group = sorted(group, key=lambda application: order[application.output])
    return list(zip(group[0::2], group[1::2], strict=False))


def _fuse_pair(graph_module: GraphModule, pair: tuple[RopeApplication, RopeApplication], positions: Node,
               cache: Node) -> int:
    """Insert rotary_embedding for (query, key) before the query's add, when both inputs exist there."""
    query, key = pair
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    if order[key.x] > order[query.output]:
        return 0
    graph = graph_module.graph
    with graph.inserting_before(query.output):
        fused = graph.call_function(octavo.rotary_embedding.default, (query.x, key.x, positions, cache))
        outputs = [graph.call_function(operator.getitem, (fused, index)) for index in (0, 1)]
    for output, application in zip(outputs, pair, strict=True):
        output.meta["val"] = application.output.meta.get("val")
    query.output.replace_all_uses_with(outputs[0])
    key.output.replace_all_uses_with(outputs[1])
    return 1


def _add_cache(graph_module: GraphModule, ctx: PassContext, cos: Node, sin: Node, positions: Node | None,
               index: int) -> Node:
    """The weight holding cos and sin for every position, evaluated from the traced subgraph.

    Where the subgraph picks its frequencies by the batch's largest position (longrope's
    `max(positions) + 1 > original_max_position_embeddings`), each position's row is
    evaluated as the last position of its batch: the rotation Hugging Face gives that
    position when it is the newest token of a sequence (generation over a KV cache).
    """
    needed = ancestors([cos, sin])
    if positions is None or positions not in needed:
        raise PassError("fuse_rope: the rotary cos/sin do not depend on the positions input")
    num_positions = _num_positions(ctx)
    parts = []
    for start, end in position_segments(needed, positions, num_positions):
        parts.append(evaluate_subgraph(
            graph_module, [cos, sin], ctx, inputs={POSITIONS: torch.arange(start, end, dtype=torch.int64)},
            shape_only={INPUT_IDS: torch.zeros(end - start, dtype=torch.int64)}))
    cos_values = torch.cat([part[0] for part in parts], dim=1)
    sin_values = torch.cat([part[1] for part in parts], dim=1)
    expected = (1, num_positions, tensor_value(cos).shape[-1])
    if tuple(cos_values.shape) != expected or tuple(sin_values.shape) != expected:
        raise PassError(f"fuse_rope: the cos/sin subgraph gave shapes {tuple(cos_values.shape)} and "
                        f"{tuple(sin_values.shape)} for {num_positions} positions, expected {expected}")
    cache = torch.stack([cos_values[0], sin_values[0]], dim=1).contiguous()
    name = CACHE_NAME if index == 0 else f"{CACHE_NAME}_{index}"
    return ctx.add_weight(graph_module, name, cache)


def position_segments(needed: set[Node], positions: Node, num_positions: int) -> list[tuple[int, int]]:
    """Ranges of positions [start, end) whose cos/sin rows one evaluation gives exactly.

    Without a reduction over the positions the whole range is one segment. A reduction
    (amax/max) may only be compared with a number, possibly after adding one:
    `gt(amax(positions) + k, c)` (or ge) is the same for every batch whose largest position
    lies on one side of the threshold, so the range splits there and each segment is
    evaluated alone (its largest position decides, as for its own last position).
    """
    cuts = set()
    for node in needed:
        if not is_call(node, aten.amax.default, aten.max.default) or positions not in ancestors([node]):
            continue
        cuts.add(_threshold(node))
    bounds = sorted({0, num_positions, *(cut for cut in cuts if 0 < cut < num_positions)})
    return list(itertools.pairwise(bounds))


def _threshold(reduction: Node) -> int:
    """The first largest position at which `cmp(reduction + k, c)` turns true (see position_segments)."""
    node, offset = reduction, 0
    if len(node.users) == 1 and is_call(next(iter(node.users)), aten.add.Tensor):
        add = next(iter(node.users))
        if isinstance(add.args[1], int):
            node, offset = add, add.args[1]
    comparison = next(iter(node.users)) if len(node.users) == 1 else None
    if is_call(comparison, aten.gt.Scalar, aten.ge.Scalar) and isinstance(comparison.args[1], int | float):
        limit = comparison.args[1] - offset
        return int(limit) + 1 if comparison.target is aten.gt.Scalar else int(-(-limit // 1))
    raise PassError(f"fuse_rope: the rotary tables depend on the batch's largest position through "
                    f"{reduction.name} in a form Octavo cannot tabulate per position")


def _num_positions(ctx: PassContext) -> int:
    value = getattr(ctx.model_config, "max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        raise PassError("fuse_rope needs max_position_embeddings in the model config to size the cos/sin cache")
    return value
