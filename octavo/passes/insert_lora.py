"""insert_lora: an octavo.lora beside every linear that a LoRA adapter may target, fed from runtime slots."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, tensor_value
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo

TOKEN_SLOTS = "lora_token_slots"
"""The runtime input naming each token's adapter slot (int64 [T], -1: none)."""

SLOTS_SYMBOL = "max_loras"
"""The symbolic first dimension of the factor inputs: the adapter slots the engine keeps."""


@register_pass("insert_lora", "add an octavo.lora after each linear a LoRA adapter may target (multi-tenant LoRA)")
def insert_lora(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """After each `aten.linear(x, W)` of which some projection is targeted, add `octavo.lora(y, x, A, B, slots)`.

    A projection is targeted when its module name ends with one of `config.lora_targets` (PEFT's
    target_modules: "q_proj", "down_proj", ...). A merged linear (fuse_qkv, fuse_gate_up; its output
    split by `split_with_sizes`) has one projection per part: with P parts and rank R =
    `config.max_lora_rank`, its factor inputs are `lora_a_<weight>` [max_loras, P * R, in] and
    `lora_b_<weight>` [max_loras, out, P * R], part p owning rows p*R..(p+1)*R of A and the matching
    columns of B over its own output rows (block-diagonal; the runtime writes zeros elsewhere and for
    parts no adapter targets). `lora_token_slots` [T] says each token's slot. The op takes over every
    use of the linear's output. The layout (per linear: inputs, parts with module id and output rows)
    goes to `ctx.lora` for the manifest. Runs after fuse_qkv and fuse_gate_up, before quantization.
    Stats: lora_linears, lora_parts. Raises PassError when no linear matches the targets.
    """
    targets = tuple(ctx.config.lora_targets)
    rank = ctx.config.max_lora_rank
    linears = []
    for node in list(graph_module.graph.nodes):
        parts = _parts(node, ctx)
        if parts and any(_targeted(module, targets) for module, _ in parts):
            linears.append((node, parts))
    if not linears:
        raise PassError(f"insert_lora found no linear whose module ends with one of {', '.join(targets)}")
    slots = ctx.add_runtime_input(graph_module, TOKEN_SLOTS, ["T"], torch.int64, role="lora")
    layout = [_insert(graph_module, ctx, node, parts, targets, rank, slots) for node, parts in linears]
    ctx.lora = {"max_rank": rank, "targets": list(targets), "token_slots": TOKEN_SLOTS, "linears": layout}
    ctx.stats.update({"lora_linears": len(layout), "lora_parts": sum(len(entry["parts"]) for entry in layout)})
    return graph_module


def _parts(node: Node, ctx: PassContext) -> list[tuple[str, int]] | None:
    """(module id, output rows) of each projection of a linear over a weight placeholder, else None."""
    if not is_call(node, aten.linear.default) or getattr(node.args[1], "op", None) != "placeholder":
        return None
    weight = node.args[1]
    names = ctx.merged_weights.get(weight.name, [weight.name])
    if len(names) == 1:
        value = tensor_value(weight)
        return [(_module_id(names[0]), int(value.shape[0]))] if value is not None else None
    split = next((user for user in node.users if is_call(user, aten.split_with_sizes.default)), None)
    if split is None or len(split.args[1]) != len(names):
        return None
    return [(_module_id(name), int(size)) for name, size in zip(names, split.args[1], strict=True)]


def _module_id(weight_name: str) -> str:
    """A weight placeholder's module, in placeholder spelling: model_layers_0_self_attn_q_proj."""
    return weight_name.removesuffix("_weight")


def _targeted(module: str, targets: tuple[str, ...]) -> bool:
    return any(module == target or module.endswith("_" + target) for target in targets)


def _insert(graph_module: GraphModule, ctx: PassContext, linear: Node, parts: list[tuple[str, int]],
            targets: tuple[str, ...], rank: int, slots: Node) -> dict:
    value = linear.meta["val"]
    weight = linear.args[1]
    in_features = int(tensor_value(weight).shape[1])
    out_features = sum(size for _, size in parts)
    width = rank * len(parts)
    factor_a = ctx.add_runtime_input(graph_module, f"lora_a_{weight.name}", [SLOTS_SYMBOL, width, in_features],
                                     value.dtype, role="lora")
    factor_b = ctx.add_runtime_input(graph_module, f"lora_b_{weight.name}", [SLOTS_SYMBOL, out_features, width],
                                     value.dtype, role="lora")
    with graph_module.graph.inserting_after(linear):
        update = graph_module.graph.call_function(octavo.lora.default,
                                                  (linear, linear.args[0], factor_a, factor_b, slots))
    update.meta["val"] = value
    linear.replace_all_uses_with(update, delete_user_cb=lambda user: user is not update)
    rows, entries = 0, []
    for index, (module, size) in enumerate(parts):
        if _targeted(module, targets):
            entries.append({"module": module, "rows": [rows, rows + size], "rank_offset": rank * index})
        rows += size
    return {"a": factor_a.name, "b": factor_b.name, "in": in_features, "out": out_features, "width": width,
            "parts": entries}
