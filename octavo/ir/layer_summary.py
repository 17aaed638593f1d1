"""What each decoder layer computes, read off the final graph: the ops of every layer, in order.

`octavo inspect` prints it so a reader sees the fusions per layer (one qkv linear, one
rotary_embedding, two norms, ...) rather than only totals. Layout-only ops (views, permutes,
getitems, splits) are left out: they move no data a kernel computes.
"""

from __future__ import annotations

import re

from torch.fx import GraphModule, Node

from octavo.ir.graph import op_name

LAYOUT_OPS = {
    "operator.getitem", "aten.view", "aten.reshape", "aten._unsafe_view", "aten.permute", "aten.transpose.int",
    "aten.select.int", "aten.slice.Tensor", "aten.unsqueeze", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.expand", "aten.split_with_sizes", "aten.split.Tensor", "aten.sym_size.int", "aten.contiguous",
    "aten.clone", "aten.t", "aten.alias",
}
LAYER_NAME = re.compile(r"(?:^|_|\.)layers[_.](\d+)[_.](.*?)(?:[_.]weight|[_.]bias)?$")
CACHE_NAME = re.compile(r"^(?:key|value)_cache_(\d+)$")
FINAL = -1


def layer_summary(graph_module: GraphModule) -> list[dict]:
    """Consecutive layers with the same op sequence, grouped: [{"name", "ops"}], model order.

    An op belongs to the layer its weights (or KV cache pool) name; an op with neither
    (rotary, activation, pointwise) to the layer of the op before it. Ops before the first
    layer are "embedding", after the last "final". Each op is written `op` or `op(role)`,
    role = the weight's name within its layer (`self_attn_qkv_proj`), so layers compare equal.
    """
    per_layer: dict[int, list[str]] = {}
    before: list[str] = []
    after: list[str] = []
    current: int | None = None  # None: before the first layer
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or op_name(node) in LAYOUT_OPS:
            continue
        layer, role = _layer_of(node)
        if layer is not None:
            current = layer
        elif role is not None and per_layer:
            current = FINAL  # a weight outside the layers, after them: the final norm, lm_head
        label = f"{op_name(node)}({role})" if role else op_name(node)
        if current is None:
            before.append(label)
        elif current == FINAL:
            after.append(label)
        else:
            per_layer.setdefault(current, []).append(label)
    return _grouped(before, per_layer, after)


def _layer_of(node: Node) -> tuple[int | None, str | None]:
    """(layer index, weight role) from the node's placeholder arguments; role None without a weight."""
    for argument in node.all_input_nodes:
        if argument.op != "placeholder":
            continue
        cache = CACHE_NAME.match(argument.name)
        if cache:
            return int(cache.group(1)), None
        named = LAYER_NAME.search(argument.name)
        if named:
            return int(named.group(1)), named.group(2)
        if argument.name.endswith(("weight", "bias")):
            return None, argument.name.removeprefix("model_").removesuffix("_weight")
    return None, None


def _grouped(before: list[str], per_layer: dict[int, list[str]], after: list[str]) -> list[dict]:
    groups: list[dict] = []
    if before:
        groups.append({"name": "embedding", "ops": before})
    start = None
    for index in sorted(per_layer):
        if start is None or per_layer[index] != per_layer[start]:
            start = index
            groups.append({"name": f"layer {index}", "ops": per_layer[index], "first": index, "last": index})
        else:
            groups[-1]["last"] = index
    for group in groups:
        if "first" in group:
            first, last = group.pop("first"), group.pop("last")
            group["name"] = f"layer {first}" if first == last else f"layers {first}-{last}"
    if after:
        groups.append({"name": "final", "ops": after})
    return groups
