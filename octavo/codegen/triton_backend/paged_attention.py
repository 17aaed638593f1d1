"""Triton launcher of octavo.paged_attention: cache write, then decode and prefill attention kernels.

The op's semantics are in octavo.ir.ops.attention.paged_attention. The three
kernels live in kv_cache_write.py, attention_decode.py and
attention_prefill.py; this file only orders them. On a GPU both attention
kernels are launched for every batch: each sequence is computed by exactly
one of them (query length 1: decode; longer: prefill) and the other
kernel's program for it returns at once. No tensor value is read on the
host there, so a step's launches depend only on its shapes.
"""

from __future__ import annotations

from torch import Tensor

from octavo.codegen.triton_backend.attention_decode import decode_attention
from octavo.codegen.triton_backend.attention_prefill import prefill_attention
from octavo.codegen.triton_backend.availability import QUANTIZED_CACHE_ERROR
from octavo.codegen.triton_backend.kv_cache_write import write_kv_cache
from octavo.errors import OctavoError


def paged_attention(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                    slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                    scale: float, sliding_window: int = -1, key_scale_cache: Tensor | None = None,
                    value_scale_cache: Tensor | None = None, soft_cap: float = 0.0) -> Tensor:
    """Same semantics as octavo.ir.ops.attention.paged_attention; returns [T, Hq, D] in query's dtype.

    Quantized (int8 / fp8) caches are not supported (the engine refuses such an artifact on this backend at load,
    see availability.check_triton_kv_layout).
    """
    if key_scale_cache is not None or value_scale_cache is not None:
        raise OctavoError(QUANTIZED_CACHE_ERROR)
    if key.shape[-1] != value.shape[-1] or key_cache.stride() != value_cache.stride():
        raise ValueError("the Triton paged attention needs keys and values of one head dim and cache layout")
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    output = query.new_empty(query.shape)
    has_decodes = has_prefills = True
    if query.device.type == "cpu":
        # Triton's interpreter: reading the lengths costs nothing here, while every program that would
        # only return at once costs milliseconds; skip a kernel that has no sequence to compute.
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        has_decodes, has_prefills = bool((query_lens == 1).any()), bool((query_lens > 1).any())
    if has_decodes:
        decode_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                         sliding_window, output, soft_cap)
    if has_prefills:
        prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                          sliding_window, output, soft_cap)
    return output

