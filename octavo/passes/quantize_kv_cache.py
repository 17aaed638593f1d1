"""quantize_kv_cache: store the paged KV cache as int8 or float8_e4m3fn with per-token, per-head scales.

Runs with ``--kv-cache-dtype int8|fp8``, after match_attention. For every layer's
``octavo.paged_attention``:

- the cache inputs ``key_cache_i`` / ``value_cache_i`` become int8 (or float8_e4m3fn)
  [num_blocks, block_size, Hkv, D] instead of the model dtype;
- new runtime inputs ``key_scale_cache_i`` / ``value_scale_cache_i``, float32
  [num_blocks, block_size, Hkv], are passed as the op's ``key_scale_cache`` and
  ``value_scale_cache`` arguments.

By paged_attention's definition the cache write then quantizes each (token, kv head)
vector with its own scale (max|x| / 127 for int8, / 448 for fp8) and every read
dequantizes in float32, so the graph computes attention over the quantized-then-restored
keys and values; nothing else in the graph changes. One float32 scale per 64-value
head vector adds 4 bytes to its 64 (int8): the cache takes 53% of a bfloat16 one and
27% of a float32 one.

``ctx.kv_layout`` gets ``cache_dtype`` (int8 / float8_e4m3fn), ``scale_dtype``
(float32), ``scale_layout`` and ``scale_inputs`` (the per-layer pair of names), so the
runtime allocates the scale pools next to the caches and moves them with their blocks.
Stats: quantized_layers, cache_dtype.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.context import PassContext
from octavo.passes.registry import register_pass

octavo = torch.ops.octavo

CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_LAYOUT = "one float32 scale per token and kv head: [num_blocks, block_size, num_kv_heads]"
_SCALE_ARGUMENT = 11  # paged_attention's key_scale_cache (value_scale_cache follows)


@register_pass("quantize_kv_cache", "store the KV cache as int8/fp8 with a float32 scale per token and kv head "
               "(--kv-cache-dtype)")
def quantize_kv_cache(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """See the module docstring."""
    dtype = CACHE_DTYPES.get(ctx.config.kv_cache_dtype)
    if dtype is None:
        raise PassError(f"quantize_kv_cache needs --kv-cache-dtype int8 or fp8, got {ctx.config.kv_cache_dtype}")
    attentions = find_nodes(graph_module, octavo.paged_attention.default)
    if not attentions or ctx.kv_layout is None:
        raise PassError("quantize_kv_cache found no octavo.paged_attention node; it runs after match_attention")
    layout = ctx.kv_layout
    scale_shape = ["num_blocks", layout["block_size"], layout["num_kv_heads"]]
    scale_inputs = []
    for index, attention in enumerate(attentions):
        if any(arg is not None for arg in attention.args[_SCALE_ARGUMENT:_SCALE_ARGUMENT + 2]) or attention.kwargs:
            raise PassError(f"{attention.name} already has KV scale inputs")
        for cache in attention.args[3:5]:
            cache.meta["val"] = ctx.fake_tensor(ctx.runtime_inputs[cache.name]["shape"], dtype)
            ctx.runtime_inputs[cache.name]["dtype"] = str(dtype).removeprefix("torch.")
        names = [f"key_scale_cache_{index}", f"value_scale_cache_{index}"]
        scales = [ctx.add_runtime_input(graph_module, name, scale_shape, torch.float32, role)
                  for name, role in zip(names, ("key_scale_cache", "value_scale_cache"), strict=True)]
        window = attention.args[10] if len(attention.args) > 10 else -1
        # Arguments after the scale caches (a soft-cap) stay.
        attention.args = (*attention.args[:10], window, *scales, *attention.args[_SCALE_ARGUMENT + 2:])
        scale_inputs.append(names)
    layout.update(cache_dtype=str(dtype).removeprefix("torch."), scale_dtype="float32", scale_layout=SCALE_LAYOUT,
                  scale_inputs=scale_inputs)
    ctx.quantization = {**(ctx.quantization or {"scheme": "none"}),
                        "kv_cache": {"dtype": ctx.config.kv_cache_dtype, "scales": SCALE_LAYOUT}}
    ctx.stats.update({"quantized_layers": len(attentions), "cache_dtype": layout["cache_dtype"]})
    return graph_module
