"""match_attention: SDPA or eager attention + GQA repeat_kv + causal mask -> octavo.paged_attention."""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.passes.attention_patterns import AttentionSite, find_attention_sites
from octavo.passes.canonicalize import eliminate_dead_nodes, is_full_slice
from octavo.passes.context import PassContext
from octavo.passes.registry import register_pass

aten = torch.ops.aten
octavo = torch.ops.octavo

# The ops through which HF's repeat_kv expands kv heads to query heads:
# x[:, :, None] -> expand -> (clone ->) reshape.
_REPEAT_KV_VIEWS = {aten._unsafe_view.default, aten.view.default, aten.reshape.default}


@register_pass(
    "match_attention",
    "replace each attention (SDPA or eager, with its GQA repeat and causal mask) by octavo.paged_attention",
    required=True,
)
def match_attention(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """Rewrite every attention into `octavo.paged_attention`.

    An attention is an `aten.scaled_dot_product_attention` or transformers' eager
    attention (matmul, scale, optional tanh soft-cap, mask, softmax, matmul; see
    attention_patterns). A soft-cap becomes the op's `soft_cap` argument.
    Each attention of the traced graph sees q [1, Hq, T, D] and k/v [1, Hq, T, D]
    repeated from [1, Hkv, T, D] (or not repeated, with enable_gqa). The
    replacement takes the *unrepeated* k/v as [T, Hkv, D], so the cache
    stores kv heads only, and returns [T, Hq, D] permuted back to SDPA's
    layout. Layer i gets cache inputs key_cache_i / value_cache_i
    [num_blocks, block_size, Hkv, D]; all layers share slot_mapping [T],
    block_tables [B, max_blocks], seq_lens [B] and query_start_loc [B+1].
    The causal mask subgraph (and the repeat) become dead and are removed;
    the mask's meaning (causal, per-sequence, sliding window from the config)
    is carried by paged_attention's definition. Raises if nothing matched.
    Stats: replaced_sdpa, replaced_eager, removed_repeat_kv, soft_caps (per
    layer, 0 for none), dead_nodes.
    """
    sites = find_attention_sites(graph_module)
    if not sites:
        raise PassError("match_attention found no scaled_dot_product_attention and no eager attention "
                        "(matmul, softmax, matmul): the model's attention is not supported")
    windows = ctx.architecture.sliding_windows(ctx.model_config)
    if len(windows) != len(sites):
        raise PassError(f"match_attention found {len(sites)} attention nodes for "
                        f"{len(windows)} layers in the config")
    metadata = _add_metadata_inputs(graph_module, ctx)
    layers = [_replace_attention(graph_module, ctx, site, index, windows[index], metadata)
              for index, site in enumerate(sites)]
    ctx.kv_layout = _kv_layout(ctx, layers, windows)
    eager = sum(1 for site in sites if site.output.target is not aten.scaled_dot_product_attention.default)
    ctx.stats.update({
        "replaced_sdpa": len(sites) - eager,
        "replaced_eager": eager,
        "soft_caps": [site.soft_cap for site in sites],
        "removed_repeat_kv": sum(layer["repeated"] for layer in layers),
        "dead_nodes": eliminate_dead_nodes(graph_module),
    })
    return graph_module


def _add_metadata_inputs(graph_module: GraphModule, ctx: PassContext) -> dict[str, Node]:
    specs = {
        "slot_mapping": (["T"], torch.int64),
        "block_tables": (["B", "max_blocks"], torch.int32),
        "seq_lens": (["B"], torch.int32),
        "query_start_loc": (["B+1"], torch.int32),
    }
    return {name: ctx.add_runtime_input(graph_module, name, shape, dtype, role="attention_metadata")
            for name, (shape, dtype) in specs.items()}


def _replace_attention(graph_module: GraphModule, ctx: PassContext, site: AttentionSite, layer: int, window: int,
                       metadata: dict[str, Node]) -> dict:
    query, key, value, output = site.query, site.key, site.value, site.output
    key_heads, repeated_key = _strip_repeat_kv(key)
    value_heads, repeated_value = _strip_repeat_kv(value)
    query_shape = query.meta["val"].shape
    key_shape = key_heads.meta["val"].shape
    head_dim = int(query_shape[-1])
    scale = site.scale or 1.0 / math.sqrt(head_dim)
    cache_shape = ["num_blocks", ctx.config.block_size, int(key_shape[1]), int(key_shape[-1])]
    cache_dtype = key_heads.meta["val"].dtype
    key_cache = ctx.add_runtime_input(graph_module, f"key_cache_{layer}", cache_shape, cache_dtype, "key_cache")
    value_cache = ctx.add_runtime_input(graph_module, f"value_cache_{layer}", cache_shape, cache_dtype,
                                        "value_cache")
    graph = graph_module.graph
    # The scale caches (None: not quantized) sit between the window and the soft-cap.
    soft_cap = (None, None, site.soft_cap) if site.soft_cap else ()
    with graph.inserting_before(output):
        flat = [graph.call_function(aten.select.int, (graph.call_function(aten.permute.default,
                                                                          (tensor, [0, 2, 1, 3])), 0, 0))
                for tensor in (query, key_heads, value_heads)]
        attention = graph.call_function(octavo.paged_attention.default, (
            *flat, key_cache, value_cache, metadata["slot_mapping"], metadata["block_tables"],
            metadata["seq_lens"], metadata["query_start_loc"], float(scale), window, *soft_cap))
        batched = graph.call_function(aten.unsqueeze.default, (attention, 0))
        result = graph.call_function(aten.permute.default, (batched, [0, 2, 1, 3]))
    output.replace_all_uses_with(result)
    graph.erase_node(output)
    return {"num_kv_heads": int(key_shape[1]), "head_dim": int(key_shape[-1]), "num_heads": int(query_shape[1]),
            "dtype": str(cache_dtype).removeprefix("torch."), "repeated": int(repeated_key or repeated_value)}


def _strip_repeat_kv(tensor: Node) -> tuple[Node, bool]:
    """The [1, Hkv, T, D] tensor that HF's repeat_kv expanded, or `tensor` itself if not repeated."""
    node = tensor
    if node.target in _REPEAT_KV_VIEWS:
        node = node.args[0]
        if node.target is aten.clone.default:
            node = node.args[0]
        if node.target is aten.expand.default:
            unsqueezed = node.args[0]
            # The traced `[:, :, None, :, :]` leaves whole-dimension slices when canonicalize did not run.
            while is_full_slice(unsqueezed):
                unsqueezed = unsqueezed.args[0]
            if unsqueezed.target is aten.unsqueeze.default and unsqueezed.args[1] == 2:
                return unsqueezed.args[0], True
    return tensor, False


def _kv_layout(ctx: PassContext, layers: list[dict], windows: list[int]) -> dict:
    first = layers[0]
    for index, layer in enumerate(layers):
        if (layer["num_kv_heads"], layer["head_dim"]) != (first["num_kv_heads"], first["head_dim"]):
            raise PassError(f"layer {index} has a different kv shape; per-layer kv shapes are not supported")
    return {
        "num_layers": len(layers),
        "num_kv_heads": first["num_kv_heads"],
        "num_heads": first["num_heads"],
        "head_dim": first["head_dim"],
        "block_size": ctx.config.block_size,
        "cache_dtype": first["dtype"],
        "sliding_windows": windows,
        "cache_inputs": [[f"key_cache_{index}", f"value_cache_{index}"] for index in range(len(layers))],
    }
