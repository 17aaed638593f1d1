"""Helpers shared by the Triton kernel tests (imported by module name from this directory)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_close_for_dtype(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: a few ulps of float32 accumulation; bf16/fp16: about one ulp of the 16-bit type."""
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@dataclass
class PagedBatch:
    """Inputs of one paged_attention call (caches pre-filled with earlier steps' context, NaN elsewhere)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def args(self, key_cache=None, value_cache=None) -> tuple:
        return (self.query, self.key, self.value,
                self.key_cache if key_cache is None else key_cache,
                self.value_cache if value_cache is None else value_cache,
                self.slot_mapping, self.block_tables, self.seq_lens, self.query_start_loc)


def make_paged_batch(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, dtype: torch.dtype, device: torch.device, padding_tokens: int = 0,
                     seed: int = 0) -> PagedBatch:
    """A flattened batch: sequence b has seq_lens[b] context tokens, the last query_lens[b] of them new.

    Blocks are assigned from a shuffled pool (so block tables are not the
    identity); the context before this step's tokens is already cached; every
    other slot holds NaN, which a kernel must never let into a result.
    `padding_tokens` extra tokens at the end carry slot -1 and belong to no sequence.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = pool[used:used + count].to(torch.int32)
        used += count
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    flat_keys, flat_values = key_cache.view(-1, num_kv_heads, head_dim), value_cache.view(-1, num_kv_heads, head_dim)
    slots = []
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        positions = torch.arange(seq_len)
        seq_slots = block_tables[row, positions // block_size].long() * block_size + positions % block_size
        cached = seq_slots[:seq_len - query_len]
        flat_keys[cached] = torch.randn(len(cached), num_kv_heads, head_dim, generator=generator).to(dtype)
        flat_values[cached] = torch.randn(len(cached), num_kv_heads, head_dim, generator=generator).to(dtype)
        slots.append(seq_slots[seq_len - query_len:])
    slots.append(torch.full((padding_tokens,), -1, dtype=torch.int64))
    num_tokens = sum(query_lens) + padding_tokens
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return PagedBatch(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype).to(device),
        key=torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype).to(device),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype).to(device),
        key_cache=key_cache.to(device), value_cache=value_cache.to(device),
        slot_mapping=torch.cat(slots).to(device), block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device), query_start_loc=query_start_loc.to(device),
    )
