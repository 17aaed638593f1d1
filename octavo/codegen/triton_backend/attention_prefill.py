"""Triton kernel: paged attention for prefill chunks (varlen, causal, over the cached context).

Semantics: octavo.ir.ops.attention.paged_attention, steps 2-3, for the
sequences with more than one query token (one-token sequences are left to
attention_decode). Sequence b owns query rows ``query_start_loc[b] :
query_start_loc[b + 1]`` (q_len of them), the last q_len of its
``seq_lens[b]`` context positions; query row i sits at position
``p = seq_len - q_len + i`` and attends to the cached positions ``j <= p``
(and ``j > p - sliding_window`` when the window is positive), read through
the block table: ``softmax(s_j) @ v_j`` in float32, ``s_j = scale * q . k_j``
(soft-capped, ``soft_cap * tanh(s_j / soft_cap)``, when ``soft_cap > 0``).

Grid: (query tiles, query heads). The tiles of all sequences are numbered
one after the other, sequence b's first tile being
``query_start_loc[b] // BLOCK_M + b``; ``cdiv(T, BLOCK_M) + B`` tiles cover
any batch, so the launch depends on shapes only (no host sync, CUDA-graph
friendly) and a program finds its sequence by binary search.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from octavo.codegen.triton_backend.attention_decode import LOG2_E, dot_precision
from octavo.codegen.triton_backend.availability import interpreting


@triton.jit
def _prefill_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    query_stride_t, query_stride_h, query_stride_d,
    output_stride_t, output_stride_h, output_stride_d,
    cache_stride_block, cache_stride_offset, cache_stride_h, cache_stride_d,
    block_tables_stride,
    qk_scale, soft_cap, sliding_window, head_dim, group_size, block_size, num_seqs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,  # noqa: N803
    DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr,  # noqa: N803
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group_size

    # Find the sequence owning this tile: the last b whose first tile is <= tile (binary search).
    # (Explicit int32 scalars: both are loop-carried, and Triton may pass num_seqs == 1 as a constant.)
    low = tl.full([], 0, tl.int32)
    high = tl.full([], 0, tl.int32) + num_seqs
    while high - low > 1:
        middle = (low + high) // 2
        middle_first_tile = tl.load(query_start_loc_ptr + middle) // BLOCK_M + middle
        low = tl.where(middle_first_tile <= tile, middle, low)
        high = tl.where(middle_first_tile <= tile, high, middle)
    seq = low
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_row = (tile - (query_start // BLOCK_M + seq)) * BLOCK_M
    # Spare tiles past the sequence's rows, and decodes (the decode kernel's), have nothing to do.
    if (first_row >= query_len) | (query_len <= 1):
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # This tile's query rows [BLOCK_M, BLOCK_D] and their positions in the sequence.
    rows = first_row + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < query_len
    positions = seq_len - query_len + rows
    query_mask = row_valid[:, None] & (dims[None, :] < head_dim)
    query = tl.load(query_ptr + (query_start + rows)[:, None] * query_stride_t + head * query_stride_h
                    + dims[None, :] * query_stride_d, mask=query_mask, other=0.0).to(tl.float32)

    # Online-softmax state per row: running max (log2 domain), running sum, weighted values.
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    accumulator = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys from the window start of the tile's first row to the tile's last row's position.
    last_position = seq_len - query_len + tl.minimum(first_row + BLOCK_M, query_len) - 1
    lowest = tl.where(sliding_window > 0, seq_len - query_len + first_row - sliding_window + 1, 0)
    lowest = tl.maximum(lowest, 0)
    for block_start in range(lowest // BLOCK_N * BLOCK_N, last_position + 1, BLOCK_N):
        key_positions = block_start + tl.arange(0, BLOCK_N)
        in_context = (key_positions >= lowest) & (key_positions <= last_position)
        # Block-table indirection: position -> physical block, offset inside it.
        physical_block = tl.load(block_tables_ptr + seq * block_tables_stride + key_positions // block_size,
                                 mask=in_context, other=0).to(tl.int64)
        cache_offsets = (physical_block[:, None] * cache_stride_block
                         + (key_positions % block_size)[:, None] * cache_stride_offset
                         + kv_head * cache_stride_h + dims[None, :] * cache_stride_d)
        tile_mask = in_context[:, None] & (dims[None, :] < head_dim)
        keys = tl.load(key_cache_ptr + cache_offsets, mask=tile_mask, other=0.0).to(tl.float32)
        values = tl.load(value_cache_ptr + cache_offsets, mask=tile_mask, other=0.0).to(tl.float32)

        # Causal (and sliding-window) visibility per (row, key); -inf scores where hidden.
        visible = in_context[None, :] & (key_positions[None, :] <= positions[:, None])
        visible = visible & ((sliding_window <= 0) | (key_positions[None, :] > positions[:, None] - sliding_window))
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * qk_scale
        if SOFT_CAP:
            # soft_cap * tanh(s / soft_cap) on the natural scores s = scores / log2(e), back to the log2 domain;
            # tanh(x) = 2 sigmoid(2x) - 1. soft_cap arrives multiplied by log2(e), so the scale cancels.
            scores = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)
        scores = tl.where(visible, scores, float("-inf"))

        # Rescale the running state to the new max; a row with no visible key yet shifts by 0, not -inf.
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probabilities = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(running_max - shift)
        running_sum = running_sum * correction + tl.sum(probabilities, 1)
        accumulator = accumulator * correction[:, None] + tl.dot(probabilities, values,
                                                                 input_precision=DOT_PRECISION)
        running_max = new_max

    # Normalize (padding rows have a zero sum: divide by 1 there) and store in the output dtype.
    output = accumulator / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(output_ptr + (query_start + rows)[:, None] * output_stride_t + head * output_stride_h
             + dims[None, :] * output_stride_d, output.to(output_ptr.dtype.element_ty), mask=query_mask)


def prefill_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                      seq_lens: Tensor, query_start_loc: Tensor, scale: float, sliding_window: int,
                      output: Tensor, soft_cap: float = 0.0) -> None:
    """Write into `output` [T, Hq, D] the attention of every sequence with several query tokens."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return
    # fp32 dots run on CUDA cores ("ieee"): smaller query tiles keep the accumulator in registers.
    block_m, block_n = (16, 16) if interpreting() else (64 if query.element_size() < 4 else 32, 32)
    num_tiles = triton.cdiv(num_tokens, block_m) + num_seqs
    _prefill_attention_kernel[(num_tiles, num_heads)](
        query, key_cache, value_cache, output,
        block_tables, seq_lens, query_start_loc,
        *query.stride(), *output.stride(), *key_cache.stride(), block_tables.stride(0),
        scale * LOG2_E, soft_cap * LOG2_E, sliding_window, head_dim, num_heads // key_cache.shape[2],
        key_cache.shape[1], num_seqs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=dot_precision(query), SOFT_CAP=soft_cap > 0,
    )
