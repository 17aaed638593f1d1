"""Triton kernel: paged attention for decode tokens (one query token per sequence), GQA-aware.

Semantics: octavo.ir.ops.attention.paged_attention, step 2-3, for the
sequences whose query length is exactly 1 (other sequences are left to
attention_prefill). The query at position ``p = seq_len - 1`` attends to
the cached positions ``j <= p`` (and ``j > p - sliding_window`` when the
window is positive): ``softmax(s_j) @ v_j`` in float32, ``s_j = scale * q . k_j``
(soft-capped, ``soft_cap * tanh(s_j / soft_cap)``, when ``soft_cap > 0``).

One program serves one (sequence, kv head) pair: it loads the query rows of
every query head in that kv head's group at once, so each key/value tile is
read from the cache once per group instead of once per query head.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from octavo.codegen.triton_backend.availability import interpreting

LOG2_E = 1.4426950408889634


@triton.jit
def _decode_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    query_stride_t, query_stride_h, query_stride_d,
    output_stride_t, output_stride_h, output_stride_d,
    cache_stride_block, cache_stride_offset, cache_stride_h, cache_stride_d,
    block_tables_stride,
    qk_scale, soft_cap, sliding_window, head_dim, group_size, block_size,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
    DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,  # noqa: N803
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    query_row = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_row
    # Only one-token sequences are decodes; the prefill kernel computes every other sequence.
    if query_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    position = seq_len - 1

    # The query rows of the group's heads, [BLOCK_G, BLOCK_D]; rows past the group are zero padding.
    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + group
    query_mask = (group[:, None] < group_size) & (dims[None, :] < head_dim)
    query = tl.load(query_ptr + query_row * query_stride_t + heads[:, None] * query_stride_h
                    + dims[None, :] * query_stride_d, mask=query_mask, other=0.0).to(tl.float32)

    # Online-softmax state per query head: running max (log2 domain), running sum, weighted values.
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    accumulator = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    # The first visible position: 0, or the start of the sliding window.
    lowest = tl.where(sliding_window > 0, position - sliding_window + 1, 0)
    lowest = tl.maximum(lowest, 0)
    for block_start in range(lowest // BLOCK_N * BLOCK_N, seq_len, BLOCK_N):
        key_positions = block_start + tl.arange(0, BLOCK_N)
        visible = (key_positions >= lowest) & (key_positions < seq_len)
        # Block-table indirection: position -> physical block, offset inside it.
        physical_block = tl.load(block_tables_ptr + seq * block_tables_stride + key_positions // block_size,
                                 mask=visible, other=0).to(tl.int64)
        cache_offsets = (physical_block[:, None] * cache_stride_block
                         + (key_positions % block_size)[:, None] * cache_stride_offset
                         + kv_head * cache_stride_h + dims[None, :] * cache_stride_d)
        tile_mask = visible[:, None] & (dims[None, :] < head_dim)
        # Masked loads read 0: slots past the sequence may hold any bits, NaN included.
        keys = tl.load(key_cache_ptr + cache_offsets, mask=tile_mask, other=0.0).to(tl.float32)
        values = tl.load(value_cache_ptr + cache_offsets, mask=tile_mask, other=0.0).to(tl.float32)

        # Scores in the log2 domain, -inf where the key is not visible.
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP:
            # soft_cap * tanh(s / soft_cap) on the natural scores s = scores / log2(e), back to the log2 domain;
            # tanh(x) = 2 sigmoid(2x) - 1. soft_cap arrives multiplied by log2(e), so the scale cancels.
            scores = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)
        scores = tl.where(visible[None, :], scores, float("-inf"))

        # Rescale the running state to the new max; a row with no visible key yet shifts by 0, not -inf.
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probabilities = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(running_max - shift)
        running_sum = running_sum * correction + tl.sum(probabilities, 1)
        accumulator = accumulator * correction[:, None] + tl.dot(probabilities, values,
                                                                 input_precision=DOT_PRECISION)
        running_max = new_max

    # Normalize and store the group's rows in the output dtype.
    output = accumulator / running_sum[:, None]
    tl.store(output_ptr + query_row * output_stride_t + heads[:, None] * output_stride_h
             + dims[None, :] * output_stride_d, output.to(output_ptr.dtype.element_ty), mask=query_mask)


def decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                     seq_lens: Tensor, query_start_loc: Tensor, scale: float, sliding_window: int,
                     output: Tensor, soft_cap: float = 0.0) -> None:
    """Write into `output` [T, Hq, D] the attention of every one-token sequence (see module docstring).

    Reads no tensor value on the host, so the launch is the same for any
    batch of the same shapes (CUDA-graph friendly).
    """
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if num_seqs == 0 or query.shape[0] == 0:
        return
    group_size = num_heads // num_kv_heads
    block_n = 16 if interpreting() else 64
    _decode_attention_kernel[(num_seqs, num_kv_heads)](
        query, key_cache, value_cache, output,
        block_tables, seq_lens, query_start_loc,
        *query.stride(), *output.stride(), *key_cache.stride(), block_tables.stride(0),
        scale * LOG2_E, soft_cap * LOG2_E, sliding_window, head_dim, group_size, key_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group_size)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), DOT_PRECISION=dot_precision(query), SOFT_CAP=soft_cap > 0,
    )


def dot_precision(query: Tensor) -> str:
    """fp32 inputs: exact fp32 products ("ieee"). bf16/fp16 inputs: "tf32", exact for their values.

    tf32 has a 10-bit mantissa and fp32's exponent, so every bf16 and fp16
    value converts to it exactly: the products are those of the native
    16-bit dot, on tensor cores, while the kernel itself only handles fp32
    (Triton's interpreter mishandles bf16 dots).
    """
    return "ieee" if query.element_size() >= 4 else "tf32"
