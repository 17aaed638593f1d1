"""Triton kernel: write one step's keys and values into the paged KV cache at `slot_mapping`.

Semantics (octavo.ir.ops.attention.paged_attention, step 1): for every token t
with ``slot_mapping[t] >= 0``, ``key[t]`` and ``value[t]`` ([Hkv, D]) go to
block ``slot // block_size``, offset ``slot % block_size`` of the caches
([num_blocks, block_size, Hkv, D]), cast to the cache dtype. Negative slots
(padding tokens) are skipped.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from octavo.codegen.triton_backend.availability import rows_per_program


@triton.jit
def _kv_cache_write_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride_t, key_stride_h, key_stride_d,
    value_stride_t, value_stride_h, value_stride_d,
    cache_stride_block, cache_stride_offset, cache_stride_h, cache_stride_d,
    num_tokens, num_kv_heads, head_dim, block_size,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
):
    # A [BLOCK_T, BLOCK_H * BLOCK_D] tile: BLOCK_T tokens, all kv heads and dims of each flattened into columns.
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    columns = tl.arange(0, BLOCK_H * BLOCK_D)
    heads = columns // BLOCK_D
    dims = columns % BLOCK_D
    # Padding tokens carry a negative slot and are not cached (nor are tokens past the batch).
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    mask = (slots >= 0)[:, None] & ((heads < num_kv_heads) & (dims < head_dim))[None, :]
    # The tokens' keys and values in the step's [T, Hkv, D] tensors.
    key = tl.load(key_ptr + tokens[:, None] * key_stride_t + (heads * key_stride_h + dims * key_stride_d)[None, :],
                  mask=mask, other=0.0)
    value = tl.load(value_ptr + tokens[:, None] * value_stride_t
                    + (heads * value_stride_h + dims * value_stride_d)[None, :], mask=mask, other=0.0)
    # Their place in the cache: block slot // block_size, offset slot % block_size, then head and dim.
    cache_offsets = ((slots // block_size) * cache_stride_block + (slots % block_size) * cache_stride_offset)[:, None] \
        + (heads * cache_stride_h + dims * cache_stride_d)[None, :]
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                   slot_mapping: Tensor) -> None:
    """key/value [T, Hkv, D] -> cache slots `slot_mapping` (negative slots are skipped); in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same layout")
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    block_t = rows_per_program(block_h * block_d, num_tokens)
    _kv_cache_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(),
        *key.stride(), *value.stride(), *key_cache.stride(),
        num_tokens, num_kv_heads, head_dim, key_cache.shape[1],
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
    )
