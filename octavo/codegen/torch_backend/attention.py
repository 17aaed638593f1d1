"""Torch (CPU) kernel for octavo.paged_attention: batched decode, per-sequence SDPA for prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def paged_attention(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                    slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                    scale: float, sliding_window: int = -1) -> Tensor:
    """Same semantics as octavo.ir.ops.attention.paged_attention (see its docstring).

    Sequences with one query token (decodes) are computed together: their
    contexts are gathered into one padded [B, L, Hkv, D] tensor and
    attended with a length mask. Sequences with several query tokens
    (prefill chunks, speculative verification) each run one SDPA call
    over their gathered context.
    """
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    output = query.new_empty(query.shape[:-1] + value.shape[-1:])
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    single = (query_lens == 1).nonzero().flatten()
    if single.numel():
        rows = query_start_loc[single].long()
        output[rows] = _decode_attention(query[rows], key_cache, value_cache, block_tables[single],
                                         seq_lens[single], scale, sliding_window)
    multi = (query_lens > 1).nonzero().flatten().tolist()
    if multi:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        for b in multi:
            start, end = starts[b], starts[b + 1]
            output[start:end] = _prefill_attention(query[start:end], key[start:end], value[start:end], key_cache,
                                                   value_cache, block_tables[b], lens[b], scale, sliding_window)
    return output


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """key/value [T, Hkv, D] -> cache slots `slot_mapping` (negative slots are skipped)."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_context(cache: Tensor, block_table: Tensor, num_tokens: int) -> Tensor:
    """The first `num_tokens` cached tokens of one sequence: [num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:num_tokens]


def _prefill_attention(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                       block_table: Tensor, seq_len: int, scale: float, sliding_window: int) -> Tensor:
    q_len = query.shape[0]
    if q_len == seq_len and key.dtype == key_cache.dtype:
        # The chunk is the whole context, just written to the cache unchanged: read it from the inputs.
        keys, values = key, value
    else:
        keys = gather_context(key_cache, block_table, seq_len)
        values = gather_context(value_cache, block_table, seq_len)
    # SDPA layout [1, heads, tokens, dim]; enable_gqa lets each kv head serve its group without a repeat.
    q = query.transpose(0, 1).unsqueeze(0)
    k = keys.transpose(0, 1).unsqueeze(0).to(query.dtype)
    v = values.transpose(0, 1).unsqueeze(0).to(query.dtype)
    if q_len == seq_len and sliding_window <= 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        key_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        mask = key_pos <= query_pos
        if sliding_window > 0:
            mask &= key_pos > query_pos - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                      seq_lens: Tensor, scale: float, sliding_window: int) -> Tensor:
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    lengths = seq_lens.long().view(batch, 1)
    positions = torch.arange(int(lengths.max()), device=query.device).view(1, -1)
    written = positions < lengths
    # Past a sequence's end (padding to the longest) read its first token's slot instead: a slot it
    # wrote, so finite, and masked below. Unwritten slots may hold NaN bit patterns, which a masked
    # score would still carry into the softmax; table entries past a sequence's blocks are never read.
    read_positions = positions * written
    blocks = block_tables.long().gather(1, read_positions // block_size)
    slots = blocks * block_size + read_positions % block_size
    # [B, Hkv, L, D]: each sequence's context, padded to the longest.
    keys = key_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2).to(query.dtype)
    values = value_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2).to(query.dtype)
    allowed = written
    if sliding_window > 0:
        allowed = allowed & (positions > lengths - 1 - sliding_window)
    # The query heads of one kv head attend as a group of "query positions" (no repeat of K/V).
    grouped = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=allowed.view(batch, 1, 1, -1),
                                         scale=scale)
    return out.reshape(batch, num_heads, -1)
