"""Torch (CPU) kernel for octavo.paged_attention: batched (cascade) decode, per-sequence SDPA for prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.ir.ops.attention import quantize_cache_vectors


def paged_attention(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                    slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                    scale: float, sliding_window: int = -1, key_scale_cache: Tensor | None = None,
                    value_scale_cache: Tensor | None = None, soft_cap: float = 0.0) -> Tensor:
    """Same semantics as octavo.ir.ops.attention.paged_attention (see its docstring).

    Sequences with one query token (decodes) are computed together: their
    contexts are gathered into one padded [B, L, Hkv, D] tensor and
    attended with a length mask; leading blocks that all of them share
    (prefix caching) are read once instead (cascade attention, see
    _cascade_decode_attention). Sequences with several query tokens
    (prefill chunks, speculative verification) each run one SDPA call
    over their gathered context. With scale caches (int8/fp8 caches) every
    read dequantizes the gathered vectors; cascade attention is not used then.
    With a soft-cap the scores are computed by matmuls in float32 (SDPA has no cap).
    """
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping, key_scale_cache, value_scale_cache)
    scales = (key_scale_cache, value_scale_cache)
    output = query.new_empty(query.shape[:-1] + value.shape[-1:])
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    single = (query_lens == 1).nonzero().flatten()
    if single.numel():
        rows = query_start_loc[single].long()
        output[rows] = _decode_attention(query[rows], key_cache, value_cache, block_tables[single],
                                         seq_lens[single], scale, sliding_window, scales, soft_cap)
    multi = (query_lens > 1).nonzero().flatten().tolist()
    if multi:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        for b in multi:
            start, end = starts[b], starts[b + 1]
            output[start:end] = _prefill_attention(query[start:end], key[start:end], value[start:end], key_cache,
                                                   value_cache, block_tables[b], lens[b], scale, sliding_window,
                                                   scales, soft_cap)
    return output


def write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                   key_scale_cache: Tensor | None = None, value_scale_cache: Tensor | None = None) -> None:
    """key/value [T, Hkv, D] -> cache slots `slot_mapping` (negative slots are skipped), quantized when scaled."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for x, cache, scale_cache in ((key, key_cache, key_scale_cache), (value, value_cache, value_scale_cache)):
        if scale_cache is None:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))
            continue
        quantized, vector_scales = quantize_cache_vectors(x, cache.dtype)
        # index_copy_ has no float8 kernel: write the bytes through an int8 view of the same memory.
        cache.view(-1, *cache.shape[2:]).view(torch.int8).index_copy_(0, slot_mapping, quantized.view(torch.int8))
        scale_cache.view(-1, scale_cache.shape[2]).index_copy_(0, slot_mapping, vector_scales)


def gather_context(cache: Tensor, block_table: Tensor, num_tokens: int, scale_cache: Tensor | None = None) -> Tensor:
    """The first `num_tokens` cached tokens of one sequence: [num_tokens, Hkv, D] (float32 when dequantized)."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = block_table[:num_blocks].long()
    values = cache[blocks].flatten(0, 1)[:num_tokens]
    if scale_cache is None:
        return values
    return values.float() * scale_cache[blocks].flatten(0, 1)[:num_tokens].unsqueeze(-1)


def _gather_slots(cache: Tensor, scale_cache: Tensor | None, slots: Tensor) -> Tensor:
    """Cached vectors at flat slot indices `slots` (any shape): [*slots.shape, Hkv, D], dequantized when scaled."""
    values = cache.view(-1, *cache.shape[2:])[slots]
    if scale_cache is None:
        return values
    return values.float() * scale_cache.view(-1, scale_cache.shape[2])[slots].unsqueeze(-1)


def _prefill_attention(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                       block_table: Tensor, seq_len: int, scale: float, sliding_window: int,
                       scales: tuple[Tensor | None, Tensor | None] = (None, None), soft_cap: float = 0.0) -> Tensor:
    q_len = query.shape[0]
    if q_len == seq_len and key.dtype == key_cache.dtype and scales[0] is None:
        # The chunk is the whole context, just written to the cache unchanged: read it from the inputs.
        keys, values = key, value
    else:
        keys = gather_context(key_cache, block_table, seq_len, scales[0])
        values = gather_context(value_cache, block_table, seq_len, scales[1])
    # SDPA layout [1, heads, tokens, dim]; enable_gqa lets each kv head serve its group without a repeat.
    q = query.transpose(0, 1).unsqueeze(0)
    k = keys.transpose(0, 1).unsqueeze(0).to(query.dtype)
    v = values.transpose(0, 1).unsqueeze(0).to(query.dtype)
    if q_len == seq_len and sliding_window <= 0 and soft_cap <= 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        key_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        mask = key_pos <= query_pos
        if sliding_window > 0:
            mask &= key_pos > query_pos - sliding_window
        out = _masked_attention(q, k, v, mask, scale, soft_cap, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _masked_attention(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                      soft_cap: float, enable_gqa: bool = False) -> Tensor:
    """SDPA with a boolean mask, query heads grouped over fewer kv heads ([..., H, L, D] layouts); with a
    soft-cap, the same attention computed by matmuls in float32 with the scores capped (the op's definition)."""
    if soft_cap <= 0:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    group = query.shape[-3] // keys.shape[-3]
    keys = keys.float().repeat_interleave(group, dim=-3)
    values = values.float().repeat_interleave(group, dim=-3)
    scores = torch.matmul(query.float(), keys.transpose(-1, -2)) * scale
    scores = (torch.tanh(scores / soft_cap) * soft_cap).masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).to(query.dtype)


def _decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                      seq_lens: Tensor, scale: float, sliding_window: int,
                      scales: tuple[Tensor | None, Tensor | None] = (None, None), soft_cap: float = 0.0) -> Tensor:
    """Attention of one query token per sequence (query [B, Hq, D]) over its whole context: [B, Hq, D].

    When at least two float32 sequences share leading full blocks (prefix caching) and there is no
    sliding window, cascade attention reads the shared blocks once; otherwise every context is
    gathered, padded to the longest (rounded up to whole blocks).
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    # Cascade computes in float32 with its own summation order: exact for float32 queries, but in
    # bf16/fp16 it rounds differently from the SDPA kernel (which Hugging Face runs too) and flips
    # near-tied greedy choices, so reduced precision keeps the single SDPA pass.
    if batch >= 2 and sliding_window <= 0 and query.dtype == torch.float32 and scales[0] is None:
        shared_blocks = shared_prefix_blocks(block_tables, seq_lens, block_size)
        if shared_blocks:
            return _cascade_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                             shared_blocks, soft_cap)
    lengths = seq_lens.long().view(batch, 1)
    # Padded to whole blocks: the reduction over keys then has the same blocking whatever the
    # exact longest length, which keeps bf16 results closest to an unpadded single-sequence SDPA.
    padded = -(-int(lengths.max()) // block_size) * block_size
    positions = torch.arange(padded, device=query.device).view(1, -1)
    written = positions < lengths
    # Past a sequence's end (padding to the longest) read its first token's slot instead: a slot it
    # wrote, so finite, and masked below. Unwritten slots may hold NaN bit patterns, which a masked
    # score would still carry into the softmax; table entries past a sequence's blocks are never read.
    read_positions = positions * written
    blocks = block_tables.long().gather(1, read_positions // block_size)
    slots = blocks * block_size + read_positions % block_size
    # [B, Hkv, L, D]: each sequence's context, padded to the longest.
    keys = _gather_slots(key_cache, scales[0], slots).transpose(1, 2).to(query.dtype)
    values = _gather_slots(value_cache, scales[1], slots).transpose(1, 2).to(query.dtype)
    allowed = written
    if sliding_window > 0:
        allowed = allowed & (positions > lengths - 1 - sliding_window)
    # The query heads of one kv head attend as a group of "query positions" (no repeat of K/V).
    grouped = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = _masked_attention(grouped, keys, values, allowed.view(batch, 1, 1, -1), scale, soft_cap)
    return out.reshape(batch, num_heads, -1)


def shared_prefix_blocks(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> int:
    """How many leading blocks all sequences of a decode batch share, for cascade attention.

    The largest n such that columns 0..n-1 of `block_tables` hold the same block id in every row and
    ``n * block_size <= min(seq_lens) - 1``: the shared blocks are full in every sequence and each
    sequence keeps at least its newest token as its own suffix. Only columns within that limit are
    compared, so table entries past a sequence's blocks are never read. 0 when nothing is shared.
    """
    limit = (int(seq_lens.min()) - 1) // block_size
    if limit <= 0:
        return 0
    columns = block_tables[:, :limit]
    same = (columns == columns[:1]).all(0)
    # Length of the leading run of shared columns: a later match after a mismatch is no common prefix.
    return int(same.int().cumprod(0).sum())


def _cascade_decode_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                              seq_lens: Tensor, scale: float, shared_blocks: int, soft_cap: float = 0.0) -> Tensor:
    """Decode attention that reads the blocks all sequences share only once (cascade attention).

    Requires ``block_tables[:, :shared_blocks]`` equal in every row and ``shared_blocks * block_size``
    below every seq_len (as shared_prefix_blocks guarantees). Equals plain causal attention of each
    query over its sequence's whole context: the shared prefix (attended by all B*Hq queries in one
    matmul per kv head) and each sequence's own suffix are attended separately in float32 and merged
    by their maxima and exp-sums, which is exact since a softmax over the union of two key sets is the
    two partial softmaxes reweighted by their shares of the total mass. Returns [B, Hq, D].
    A soft-cap applies to each part's scores (it is a function of each score alone).
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    # [B, Hkv, G, D]: query head h reads kv head h // G.
    grouped = query.view(batch, num_kv_heads, group, head_dim).float()

    prefix_blocks = block_tables[0, :shared_blocks].long()
    prefix_keys = key_cache[prefix_blocks].flatten(0, 1).permute(1, 2, 0).float()  # [Hkv, D, P]
    prefix_values = value_cache[prefix_blocks].flatten(0, 1).transpose(0, 1).float()  # [Hkv, P, Dv]
    prefix_queries = grouped.transpose(0, 1).reshape(num_kv_heads, batch * group, head_dim)
    prefix_scores = _capped(torch.matmul(prefix_queries, prefix_keys) * scale, soft_cap)
    prefix_parts = _partial_attention(prefix_scores, prefix_values)
    # Back from [Hkv, B*G, n] to the suffix's [B, Hkv, G, n].
    prefix_max, prefix_sum, prefix_out = (part.view(num_kv_heads, batch, group, -1).transpose(0, 1)
                                          for part in prefix_parts)

    lengths = seq_lens.long().view(batch, 1)
    positions = torch.arange(shared_blocks * block_size, int(lengths.max()), device=query.device).view(1, -1)
    written = positions < lengths
    # Past a sequence's end (padding to the longest suffix) read its newest token's slot: written, so
    # finite (unwritten slots may hold NaN bit patterns), and masked below; no table entry past a
    # sequence's blocks is read.
    read_positions = torch.minimum(positions, lengths - 1)
    blocks = block_tables.long().gather(1, read_positions // block_size)
    slots = blocks * block_size + read_positions % block_size
    suffix_keys = key_cache.view(-1, num_kv_heads, head_dim)[slots].permute(0, 2, 3, 1).float()  # [B, Hkv, D, S]
    suffix_values = value_cache.view(-1, *value_cache.shape[2:])[slots].transpose(1, 2).float()  # [B, Hkv, S, Dv]
    suffix_scores = _capped(torch.matmul(grouped, suffix_keys) * scale, soft_cap).masked_fill(
        ~written.view(batch, 1, 1, -1), float("-inf"))
    suffix_max, suffix_sum, suffix_out = _partial_attention(suffix_scores, suffix_values)

    # Both sides have a finite maximum (each has at least one key), so the weights are well defined.
    merged_max = torch.maximum(prefix_max, suffix_max)
    prefix_weight, suffix_weight = torch.exp(prefix_max - merged_max), torch.exp(suffix_max - merged_max)
    out = ((prefix_out * prefix_weight + suffix_out * suffix_weight)
           / (prefix_sum * prefix_weight + suffix_sum * suffix_weight))
    return out.reshape(batch, num_heads, -1).to(query.dtype)


def _capped(scores: Tensor, soft_cap: float) -> Tensor:
    return torch.tanh(scores / soft_cap) * soft_cap if soft_cap > 0 else scores


def _partial_attention(scores: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalized attention over one part of the keys: (m, l, o) with m = max score per row,
    l = sum of exp(score - m), o = exp(score - m) @ values; m and l keep a trailing dim of size 1."""
    row_max = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - row_max)
    return row_max, weights.sum(-1, keepdim=True), torch.matmul(weights, values)
