"""octavo::paged_attention (the reference op) against a dense attention definition written here.

Each case builds a paged batch: every sequence has a full context of K/V, the
part before its query tokens is already in the cache (in blocks scattered over
the pool by a shuffled block table), and this step's K/V arrive with the query
tokens. The op must write exactly the new tokens' slots and attend each query
token over its own sequence's context, causally and within the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)

paged_attention = torch.ops.octavo.paged_attention.default
BLOCK_SIZE = 16


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    window: int, soft_cap: float = 0.0) -> torch.Tensor:
    """Float64 causal attention: query [q, Hq, D] are the last q positions of a context keys/values [L, Hkv, D].

    Query head h reads kv head h // (Hq / Hkv); position p sees positions
    max(0, p - window + 1) .. p (all of 0 .. p without a window). With a
    soft-cap c, each score s becomes c * tanh(s / c) (Gemma 2).
    """
    q_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    kv_head_of = torch.arange(num_heads) // (num_heads // num_kv_heads)
    keys, values = keys.double()[:, kv_head_of], values.double()[:, kv_head_of]
    output = torch.empty(q_len, num_heads, values.shape[-1], dtype=torch.float64)
    for i in range(q_len):
        position = context_len - q_len + i
        first = 0 if window <= 0 else max(0, position - window + 1)
        visible = slice(first, position + 1)
        scores = torch.einsum("hd,jhd->hj", query[i].double(), keys[visible]) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        output[i] = torch.einsum("hj,jhd->hd", scores.softmax(dim=-1), values[visible])
    return output


@dataclass
class PagedBatch:
    """Inputs of one op call plus what the dense definition needs to check it."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # full K/V [L, Hkv, D] of each sequence

    def arguments(self, scale: float, window: int, soft_cap: float = 0.0) -> tuple:
        capped = (None, None, soft_cap) if soft_cap else ()
        return (self.query, self.key, self.value, self.key_cache, self.value_cache, self.slot_mapping,
                self.block_tables, self.seq_lens, self.query_start_loc, scale, window, *capped)


def make_batch(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               num_padding: int = 0, num_pool_blocks: int = 40, seed: int = 0) -> PagedBatch:
    """shapes: (context length, query length) per sequence; padding tokens (slot -1) follow the sequences."""
    generator = torch.Generator().manual_seed(seed)
    pool_shape = (num_pool_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(pool_shape, generator=generator), torch.randn(pool_shape, generator=generator)
    free_blocks = torch.randperm(num_pool_blocks, generator=generator).tolist()
    max_blocks = max(math.ceil(length / BLOCK_SIZE) for length, _ in shapes) + 1
    block_tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    queries, keys, values, slots, contexts = [], [], [], [], []
    for row, (context_len, q_len) in enumerate(shapes):
        blocks = [free_blocks.pop() for _ in range(math.ceil(context_len / BLOCK_SIZE))]
        block_tables[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.arange(context_len)
        sequence_slots = torch.tensor(blocks)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        full_keys = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
        full_values = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
        cached = context_len - q_len
        key_cache.view(-1, num_kv_heads, head_dim)[sequence_slots[:cached]] = full_keys[:cached]
        value_cache.view(-1, num_kv_heads, head_dim)[sequence_slots[:cached]] = full_values[:cached]
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=generator))
        keys.append(full_keys[cached:])
        values.append(full_values[cached:])
        slots.append(sequence_slots[cached:])
        contexts.append((full_keys, full_values))
    queries.append(torch.randn(num_padding, num_heads, head_dim, generator=generator))
    keys.append(torch.randn(num_padding, num_kv_heads, head_dim, generator=generator))
    values.append(torch.randn(num_padding, num_kv_heads, head_dim, generator=generator))
    slots.append(torch.full((num_padding,), -1))
    query_lens = torch.tensor([q_len for _, q_len in shapes])
    return PagedBatch(
        query=torch.cat(queries), key=torch.cat(keys), value=torch.cat(values),
        key_cache=key_cache, value_cache=value_cache, slot_mapping=torch.cat(slots).long(),
        block_tables=block_tables, seq_lens=torch.tensor([length for length, _ in shapes], dtype=torch.int32),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(torch.int32),
        contexts=contexts)


def expected_caches(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools after the call: the old pools with exactly the non-negative slots overwritten."""
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    written = batch.slot_mapping >= 0
    slots = batch.slot_mapping[written]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = batch.key[written]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = batch.value[written]
    return key_cache, value_cache


def check_against_dense(batch: PagedBatch, scale: float, window: int, tolerance: float = 1e-5,
                        soft_cap: float = 0.0) -> None:
    expected_key_cache, expected_value_cache = expected_caches(batch)
    output = paged_attention(*batch.arguments(scale, window, soft_cap))
    assert output.shape == batch.query.shape and output.dtype == batch.query.dtype
    starts = batch.query_start_loc.tolist()
    for index, (keys, values) in enumerate(batch.contexts):
        start, end = starts[index], starts[index + 1]
        expected = dense_attention(batch.query[start:end], keys, values, scale, window, soft_cap)
        torch.testing.assert_close(output[start:end].double(), expected, atol=tolerance, rtol=tolerance,
                                   msg=lambda message, index=index: f"sequence {index}: {message}")
    assert torch.equal(batch.key_cache, expected_key_cache)
    assert torch.equal(batch.value_cache, expected_value_cache)


# (context length, query length): decodes, a whole prefill, prefill chunks over a cached context.
MIXED = [(15, 1), (16, 1), (17, 1), (16, 16), (17, 17), (33, 5), (40, 8), (1, 1)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_mixed_batch_matches_dense_definition(num_heads, num_kv_heads):
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim=8, num_padding=3)
    check_against_dense(batch, scale=0.3, window=-1)


@pytest.mark.parametrize("window", [1, 4, 16, 17])
def test_sliding_window_matches_dense_definition(window):
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=8)
    check_against_dense(batch, scale=1 / math.sqrt(8), window=window)


@pytest.mark.parametrize("window", [-1, 6])
def test_soft_capped_scores_match_dense_definition(window):
    """A cap below the scores' spread (scale 1 over 8 dims of unit normals): tanh bends them."""
    batch = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=8, num_padding=2)
    check_against_dense(batch, scale=1.0, window=window, soft_cap=2.0)


def test_soft_cap_changes_the_result_and_a_huge_cap_does_not():
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=8)
    plain = paged_attention(*batch.arguments(1.0, -1))
    assert not torch.allclose(paged_attention(*batch.arguments(1.0, -1, 2.0)), plain, atol=1e-2)
    torch.testing.assert_close(paged_attention(*batch.arguments(1.0, -1, 1e6)), plain, atol=1e-5, rtol=1e-5)


def test_window_longer_than_every_context_equals_full_attention():
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=8)
    windowed = paged_attention(*batch.arguments(0.5, 1000))
    full = paged_attention(*batch.arguments(0.5, -1))
    assert torch.equal(windowed, full)


@pytest.mark.parametrize("context_len", [15, 16, 17, 32, 33])
def test_block_boundaries(context_len):
    """Decode and chunk rows whose context ends just before, at and just after a block boundary."""
    batch = make_batch([(context_len, 1), (context_len, 3), (context_len, context_len)],
                       num_heads=4, num_kv_heads=2, head_dim=8, seed=context_len)
    check_against_dense(batch, scale=0.25, window=-1)


def test_block_table_order_is_followed():
    """A context in three blocks that are neither contiguous nor ascending in the pool."""
    batch = make_batch([(40, 2)], num_heads=2, num_kv_heads=1, head_dim=8, num_pool_blocks=6)
    assert (batch.block_tables[0, :3].diff().abs() != 1).any()
    assert not torch.equal(batch.block_tables[0, :3].sort().values, batch.block_tables[0, :3])
    check_against_dense(batch, scale=0.25, window=-1)


def test_padding_tokens_write_nothing():
    batch = make_batch([(5, 2)], num_heads=2, num_kv_heads=2, head_dim=8, num_padding=6)
    before = batch.key_cache.clone(), batch.value_cache.clone()
    check_against_dense(batch, scale=0.25, window=-1)
    changed = (batch.key_cache != before[0]).any(dim=(2, 3)).nonzero().tolist()
    block = batch.block_tables[0, 0].item()
    assert changed == [[block, 3], [block, 4]]  # only the two new tokens of the sequence
    assert (batch.value_cache != before[1]).any(dim=(2, 3)).nonzero().tolist() == changed


def test_bfloat16_inputs_are_computed_in_float32():
    """bf16 in and out, but the only error is the final rounding: at most half a bf16 ulp (plus fp32 noise)."""
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16)
    for name in ("query", "key", "value", "key_cache", "value_cache"):
        setattr(batch, name, getattr(batch, name).to(torch.bfloat16))
    batch.contexts = [(keys.to(torch.bfloat16), values.to(torch.bfloat16)) for keys, values in batch.contexts]
    output = paged_attention(*batch.arguments(0.25, -1))
    assert output.dtype == torch.bfloat16
    starts = batch.query_start_loc.tolist()
    for index, (keys, values) in enumerate(batch.contexts):
        expected = dense_attention(batch.query[starts[index]:starts[index + 1]], keys, values, 0.25, -1)
        ulp = torch.exp2(torch.floor(torch.log2(expected.abs().clamp_min(1e-30))) - 7)  # 8 significant bits
        error = (output[starts[index]:starts[index + 1]].double() - expected).abs() / ulp
        assert error.max() <= 0.51, f"sequence {index}: {error.max():.2f} bf16 ulps off"


def test_fake_impl_gives_output_shape_without_data():
    with FakeTensorMode():
        query = torch.empty(7, 6, 8, dtype=torch.bfloat16)
        key = value = torch.empty(7, 2, 8, dtype=torch.bfloat16)
        cache = torch.empty(5, BLOCK_SIZE, 2, 8, dtype=torch.bfloat16)
        output = paged_attention(query, key, value, cache, cache.clone(), torch.empty(7, dtype=torch.int64),
                                 torch.empty(2, 3, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                                 torch.empty(3, dtype=torch.int32), 0.5, -1)
    assert output.shape == (7, 6, 8)
    assert output.dtype == torch.bfloat16


def test_opcheck_schema_and_fake_impl():
    """torch.library.opcheck: declared mutations are the only ones, and the fake impl agrees with the real one."""
    batch = make_batch([(17, 3), (9, 1)], num_heads=4, num_kv_heads=2, head_dim=8)
    torch.library.opcheck(paged_attention, batch.arguments(0.25, -1), test_utils=("test_schema", "test_faketensor"))

