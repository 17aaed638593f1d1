"""octavo::paged_attention: attention over a paged KV cache for a flattened varlen batch."""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.ir.ops.mutating_op import mutating_op


@mutating_op("octavo::paged_attention",
             mutates_args=("key_cache", "value_cache", "key_scale_cache", "value_scale_cache"))
def paged_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    sliding_window: int = -1,
    key_scale_cache: Tensor | None = None,
    value_scale_cache: Tensor | None = None,
    soft_cap: float = 0.0,
) -> Tensor:
    """Causal attention of a flattened batch of query tokens over a paged KV cache.

    Shapes: ``query`` [T, Hq, D]; ``key`` and ``value`` [T, Hkv, D] (Hq a multiple
    of Hkv: query head h reads kv head ``h // (Hq // Hkv)``); ``key_cache`` and
    ``value_cache`` [num_blocks, block_size, Hkv, D]; ``slot_mapping`` int64 [T];
    ``block_tables`` int32 [B, max_blocks]; ``seq_lens`` int32 [B];
    ``query_start_loc`` int32 [B + 1]. Returns [T, Hq, D] in ``query``'s dtype.

    1. In place: for every token t with ``slot_mapping[t] >= 0``, key[t] and
       value[t] are written to cache slot ``slot_mapping[t]``, i.e. block
       ``slot // block_size``, offset ``slot % block_size``. Negative slots
       (padding tokens) are not written.
    2. Sequence b owns query tokens ``query_start_loc[b] : query_start_loc[b+1]``
       (q_len_b of them); after step 1 its context is ``seq_lens[b]`` tokens,
       held in blocks ``block_tables[b, 0 : ceil(seq_lens[b] / block_size)]``;
       its query tokens are the last q_len_b of them, so query token i of the
       sequence sits at position ``p = seq_lens[b] - q_len_b + i``.
    3. The query at position p attends to context positions j with ``j <= p``
       and, when ``sliding_window > 0``, ``j > p - sliding_window``:
       ``softmax(s_j) @ v_j`` with ``s_j = scale * q . k_j``, computed in float32.
       With ``soft_cap > 0`` the scores are capped first (Gemma 2's logit
       soft-capping): ``s_j = soft_cap * tanh(scale * q . k_j / soft_cap)``.

    Quantized caches: with int8 or float8_e4m3fn ``key_cache``/``value_cache``,
    ``key_scale_cache`` and ``value_scale_cache`` are float32 [num_blocks,
    block_size, Hkv] (also written in place). Step 1 then stores, per token and
    kv head, ``s = max|x| / 127`` (int8; the values ``round_half_even(x / s)``
    clamped to [-127, 127]) or ``s = max|x| / 448`` (fp8; ``(x / s)`` cast to
    float8_e4m3fn), with ``x`` in float32 and ``s = 1`` for an all-zero vector;
    steps 2-3 read every cached vector as ``value * s`` in float32.
    """
    _write_kv_cache(key, value, key_cache, value_cache, slot_mapping, key_scale_cache, value_scale_cache)
    output = torch.empty_like(query)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_blocks].long()
        keys = _read_blocks(key_cache, key_scale_cache, blocks)[:seq_len]
        values = _read_blocks(value_cache, value_scale_cache, blocks)[:seq_len]
        output[start:end] = _attend(query[start:end], keys, values, seq_len, scale, sliding_window, soft_cap)
    return output


@paged_attention.register_fake
def _(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
      scale, sliding_window=-1, key_scale_cache=None, value_scale_cache=None, soft_cap=0.0):
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


QUANTIZED_CACHE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""The largest magnitude a quantized cache dtype stores: a vector's max|x| maps onto it."""


def quantize_cache_vectors(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (values of `dtype` [..., D], float32 scales [...]), one scale per vector (see the op)."""
    x = x.float()
    scales = x.abs().amax(-1) / QUANTIZED_CACHE_MAX[dtype]
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    scaled = x / scales.unsqueeze(-1)
    if dtype == torch.int8:
        return scaled.round().clamp(-127, 127).to(torch.int8), scales
    return scaled.to(dtype), scales


def _write_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                    key_scale_cache: Tensor | None = None, value_scale_cache: Tensor | None = None) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for x, cache, scale_cache in ((key, key_cache, key_scale_cache), (value, value_cache, value_scale_cache)):
        if scale_cache is None:
            cache.view(-1, *cache.shape[2:])[slots] = x[valid].to(cache.dtype)
        else:
            quantized, scales = quantize_cache_vectors(x[valid], cache.dtype)
            cache.view(-1, *cache.shape[2:])[slots] = quantized
            scale_cache.view(-1, scale_cache.shape[2])[slots] = scales


def _read_blocks(cache: Tensor, scale_cache: Tensor | None, blocks: Tensor) -> Tensor:
    """The cached vectors of `blocks`, flattened to [tokens, Hkv, D] (dequantized to float32 when scaled)."""
    values = cache[blocks].flatten(0, 1)
    if scale_cache is None:
        return values
    return values.float() * scale_cache[blocks].flatten(0, 1).unsqueeze(-1)


def _attend(query: Tensor, keys: Tensor, values: Tensor, seq_len: int, scale: float,
            sliding_window: int, soft_cap: float = 0.0) -> Tensor:
    """Dense causal attention of the last len(query) positions of one sequence (the definition)."""
    q_len, num_heads, _ = query.shape
    group = num_heads // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if soft_cap > 0:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    query_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    key_pos = torch.arange(seq_len).unsqueeze(0)
    allowed = key_pos <= query_pos
    if sliding_window > 0:
        allowed &= key_pos > query_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
