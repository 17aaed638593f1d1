"""split_pipeline_stages: one pipeline stage's program, the decoder layers cut into contiguous stages."""

from __future__ import annotations

import re

import torch
from torch.fx import Graph, GraphModule, Node

from octavo.errors import PassError
from octavo.passes.context import PassContext
from octavo.passes.registry import register_pass

STAGE_INPUT_PREFIX = "stage_input_"
_LAYER_INDEX = re.compile(r"(?:^|_)layers_(\d+)_")


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible; the first stages take one more layer when it does not
    divide (the last stage also runs the final norm and the lm_head)."""
    if num_stages > num_layers:
        raise PassError(f"pipeline parallel size {num_stages} exceeds the {num_layers} decoder layers")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@register_pass("split_pipeline_stages",
               "keep one pipeline stage's layers; the values crossing a stage boundary become inputs and outputs")
def split_pipeline_stages(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Rewrite the graph into the program of stage ``s`` of ``P`` (``ctx.rank``); unchanged when P == 1.

    Each node gets a stage: a node reading a weight of decoder layer ``i``
    (a placeholder named ``..._layers_<i>_...``) or layer i's KV cache
    belongs to at least the stage owning layer i, and no node runs before
    the nodes it reads. Nodes that read only runtime inputs and layer-less
    weights (the embedding, sizes) are computed in every stage that needs
    them; everything after the last layer (final norm, lm_head) falls in the
    last stage. Stage s keeps its own nodes. Its inputs are the runtime inputs
    plus ``stage_input_<k>``: the values computed before stage s and read at
    or after it (the residual stream and the last layer's output, typically;
    values stage s does not read are passed on). A stage other than the last
    returns the tuple of values the next stage receives, in graph order; the
    last stage returns the logits. Weights and KV caches of other stages are
    dropped (never read from the artifact); ``ctx.kv_layout`` keeps the
    stage's layers and ``ctx.pipeline_stage`` records the stage, its layers
    and the dtype and shape (``"T"`` for the token count) of every input and
    output value. Stats: pp_size, pp_rank, layers, stage_inputs, stage_outputs.
    """
    position = ctx.rank
    if position is None or position.pp_size == 1:
        ctx.stats["pp_size"] = 1
        return graph_module
    layout = ctx.kv_layout
    if layout is None:
        raise PassError("split_pipeline_stages needs the KV layout (run after match_attention)")
    ranges = stage_layers(layout["num_layers"], position.pp_size)
    stage_of_layer = {layer: stage for stage, layers in enumerate(ranges) for layer in layers}
    stages = _assign_stages(graph_module, _placeholder_layers(graph_module, ctx), stage_of_layer)
    stage = position.pp_rank
    crossing = [_crossing_values(graph_module, stages, boundary) for boundary in (stage, stage + 1)]
    if stage == position.pp_size - 1:
        crossing[1] = []
    new_module = _extract_stage(graph_module, ctx, stages, stage, crossing, ranges[stage])
    kept = ranges[stage]
    ctx.kv_layout = {**layout, "num_layers": len(kept),
                     "cache_inputs": [layout["cache_inputs"][layer] for layer in kept],
                     "sliding_windows": [layout["sliding_windows"][layer] for layer in kept],
                     "first_layer": kept.start}
    removed = _drop_other_weights(new_module, ctx)
    outputs = _output_specs(new_module, ctx) if crossing[1] else []
    ctx.pipeline_stage = {"stage": stage, "num_stages": position.pp_size, "layers": [kept.start, kept.stop],
                          "inputs": [_spec(node, ctx) for node in new_module.graph.find_nodes(op="placeholder")
                                     if node.name.startswith(STAGE_INPUT_PREFIX)],
                          "outputs": outputs}
    ctx.stats.update({"pp_size": position.pp_size, "pp_rank": stage, "layers": [kept.start, kept.stop],
                      "stage_inputs": len(crossing[0]), "stage_outputs": len(crossing[1]),
                      "weights_dropped": removed})
    return new_module


def _drop_other_weights(graph_module: GraphModule, ctx: PassContext) -> int:
    names = {node.name for node in graph_module.graph.find_nodes(op="placeholder")}
    dropped = [name for name in ctx.weights if name not in names]
    for name in dropped:
        del ctx.weights[name]
    return len(dropped)


def _placeholder_layers(graph_module: GraphModule, ctx: PassContext) -> dict[Node, int]:
    """The decoder layer each layer-specific placeholder (weight or KV cache) belongs to."""
    caches = {name: layer for layer, pair in enumerate(ctx.kv_layout["cache_inputs"]) for name in pair}
    layers = {}
    for node in graph_module.graph.find_nodes(op="placeholder"):
        if node.name in caches:
            layers[node] = caches[node.name]
        elif node.name in ctx.weights and (match := _LAYER_INDEX.search(node.name)):
            layers[node] = int(match.group(1))
    if not any(node.name in ctx.weights for node in layers):
        raise PassError("split_pipeline_stages found no weight named after a decoder layer (..._layers_<i>_...)")
    return layers


def _assign_stages(graph_module: GraphModule, layers: dict[Node, int],
                   stage_of_layer: dict[int, int]) -> dict[Node, int | None]:
    """node -> stage (None: computable anywhere from runtime inputs and layer-less weights)."""
    stages: dict[Node, int | None] = {}
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            stages[node] = stage_of_layer[layers[node]] if node in layers else None
            continue
        found = [stages[argument] for argument in node.all_input_nodes if stages[argument] is not None]
        stages[node] = max(found) if found else None
    last = max(stage_of_layer.values())
    output = graph_module.graph.output_node()
    stages[output] = last
    return stages


def _crossing_values(graph_module: GraphModule, stages: dict[Node, int | None], boundary: int) -> list[Node]:
    """Computed nodes of stages before `boundary` that a node of `boundary` or later reads, in graph order."""
    crossing = []
    for node in graph_module.graph.nodes:
        stage = stages[node]
        if node.op == "placeholder" or stage is None or stage >= boundary:
            continue
        if any(stages[user] is not None and stages[user] >= boundary for user in node.users):
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise PassError(f"split_pipeline_stages: {node.name} crosses a stage boundary but is not a tensor")
            crossing.append(node)
    return crossing


def _extract_stage(graph_module: GraphModule, ctx: PassContext, stages: dict[Node, int | None], stage: int,
                   crossing: list[list[Node]], layers: range) -> GraphModule:
    """A new graph of stage `stage`'s nodes, the free nodes they need, and the boundary inputs/outputs."""
    kept = _needed_nodes(graph_module, stages, stage, crossing[1])
    cache_names = {name for layer in layers for name in ctx.kv_layout["cache_inputs"][layer]}
    all_caches = {name for pair in ctx.kv_layout["cache_inputs"] for name in pair}
    graph = Graph()
    env: dict[Node, Node] = {}
    for node in graph_module.graph.find_nodes(op="placeholder"):
        is_runtime_input = node.name not in ctx.weights and (node.name not in all_caches or node.name in cache_names)
        if is_runtime_input or node in kept:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
    for index, value in enumerate(crossing[0]):
        env[value] = graph.placeholder(f"{STAGE_INPUT_PREFIX}{index}")
        env[value].meta = {"val": value.meta["val"]}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node in kept and node not in env:
            env[node] = graph.node_copy(node, lambda argument: env[argument])
    if crossing[1]:
        graph.output(tuple(env[value] for value in crossing[1]))
    else:
        output = graph_module.graph.output_node()
        graph.output(torch.fx.map_arg(output.args[0], lambda argument: env[argument]))
    return GraphModule(torch.nn.Module(), graph)


def _needed_nodes(graph_module: GraphModule, stages: dict[Node, int | None], stage: int,
                  outgoing: list[Node]) -> set[Node]:
    """Stage `stage`'s nodes that its result needs, plus the free nodes (and placeholders) they read."""
    output = graph_module.graph.output_node()
    roots = list(outgoing) if outgoing else list(output.all_input_nodes)
    needed: set[Node] = set()
    while roots:
        node = roots.pop()
        if node in needed or (stages[node] is not None and stages[node] < stage):
            continue
        needed.add(node)
        roots.extend(node.all_input_nodes)
    return needed


def _spec(node: Node, ctx: PassContext) -> dict:
    value = node.meta["val"]
    names = ctx.symbol_names()
    shape = []
    for dim in value.shape:
        if str(dim) in names:  # a runtime size (a symbol, or at load time its example value)
            shape.append(names[str(dim)])
        elif isinstance(dim, int) or str(dim).isdigit():
            shape.append(int(dim))
        else:
            raise PassError(f"split_pipeline_stages: {node.name} has a size {dim} that is neither a constant nor "
                            "a runtime size (T, B, N)")
    return {"name": node.name, "dtype": str(value.dtype).removeprefix("torch."), "shape": shape}


def _output_specs(graph_module: GraphModule, ctx: PassContext) -> list[dict]:
    values = graph_module.graph.output_node().args[0]
    return [_spec(value, ctx) for value in values]
