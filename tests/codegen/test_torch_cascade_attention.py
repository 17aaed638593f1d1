"""Cascade (shared-prefix) decode attention in the torch kernel equals the reference op.

Decode batches here are built the way prefix caching leaves them: several
sequences' block tables start with the same physical blocks, which hold the
common prefix's keys and values once. The kernel must take the cascade path
on them (shared_prefix_blocks > 0; float32 only, reduced precision keeps the
single SDPA pass) and still give the reference op's output,
also when the pool holds garbage where no sequence wrote and when unused
block-table entries hold garbage.
"""

from __future__ import annotations

import math

import pytest
import torch

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from octavo.codegen.torch_backend.attention import paged_attention as torch_kernel
from octavo.codegen.torch_backend.attention import shared_prefix_blocks
from tests.codegen.test_torch_attention import (
    BLOCK_SIZE,
    assert_kernel_matches_reference,
    copy_batch,
    reference_op,
)


def make_shared_decode_batch(lengths: list[int], shared: list[int], num_heads: int, num_kv_heads: int,
                             head_dim: int, dtype: torch.dtype = torch.float32, pool_fill: float | None = None,
                             seed: int = 0) -> dict:
    """Arguments of one all-decode call in which sequence b's first `shared[b]` blocks are common blocks.

    The common blocks hold one common prefix (each sharing sequence's first
    shared[b] * BLOCK_SIZE tokens); every sequence's later tokens sit in blocks
    of its own. Sequence b's newest token (position lengths[b] - 1) is its
    query; its key/value are written by the call (if that position lies in a
    common block, the same values the prefix holds there). Every other slot
    holds `pool_fill` (random values when None); unused table entries hold block 0.
    """
    assert all(count * BLOCK_SIZE <= length for length, count in zip(lengths, shared, strict=True))
    generator = torch.Generator().manual_seed(seed)
    own_blocks = [math.ceil(length / BLOCK_SIZE) - count for length, count in zip(lengths, shared, strict=True)]
    num_pool_blocks = max(shared) + sum(own_blocks) + 3
    pool_shape = (num_pool_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    if pool_fill is None:
        key_cache, value_cache = (torch.randn(pool_shape, generator=generator) for _ in range(2))
    else:
        key_cache, value_cache = torch.full(pool_shape, pool_fill), torch.full(pool_shape, pool_fill)
    free_blocks = torch.randperm(num_pool_blocks, generator=generator).tolist()
    common_blocks = [free_blocks.pop() for _ in range(max(shared))]
    common_keys, common_values = (torch.randn(max(shared) * BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
                                  for _ in range(2))
    block_tables = torch.zeros(len(lengths), max(math.ceil(length / BLOCK_SIZE) for length in lengths) + 2,
                               dtype=torch.int32)
    queries, keys, values, slots = [], [], [], []
    for row, (length, count) in enumerate(zip(lengths, shared, strict=True)):
        blocks = torch.tensor(common_blocks[:count] + [free_blocks.pop() for _ in range(own_blocks[row])])
        block_tables[row, :len(blocks)] = blocks.to(torch.int32)
        positions = torch.arange(length)
        sequence_slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        own_len = length - count * BLOCK_SIZE
        full_keys = torch.cat([common_keys[:count * BLOCK_SIZE],
                               torch.randn(own_len, num_kv_heads, head_dim, generator=generator)])
        full_values = torch.cat([common_values[:count * BLOCK_SIZE],
                                 torch.randn(own_len, num_kv_heads, head_dim, generator=generator)])
        key_cache.view(-1, num_kv_heads, head_dim)[sequence_slots[:-1]] = full_keys[:-1]
        value_cache.view(-1, num_kv_heads, head_dim)[sequence_slots[:-1]] = full_values[:-1]
        queries.append(torch.randn(1, num_heads, head_dim, generator=generator))
        keys.append(full_keys[-1:])
        values.append(full_values[-1:])
        slots.append(sequence_slots[-1:])
    return {
        "query": torch.cat(queries).to(dtype), "key": torch.cat(keys).to(dtype), "value": torch.cat(values).to(dtype),
        "key_cache": key_cache.to(dtype), "value_cache": value_cache.to(dtype),
        "slot_mapping": torch.cat(slots).long(), "block_tables": block_tables,
        "seq_lens": torch.tensor(lengths, dtype=torch.int32),
        "query_start_loc": torch.arange(len(lengths) + 1, dtype=torch.int32),
        "scale": 1 / math.sqrt(head_dim), "sliding_window": -1,
    }


# (lengths, blocks each sequence shares, blocks the kernel may read once). Lengths 32, 48, 64 end on a block
# boundary, 17, 33, 49, 65 just past one. A sequence whose newest token lies in a shared block keeps that block
# as its own suffix, so "boundary" shares 2 blocks, not 3.
SCENARIOS = {
    "one_block": ([20, 17, 40, 33, 18], [1, 1, 1, 1, 1], 1),
    "several_blocks": ([70, 49, 64, 97, 65, 50], [3, 3, 3, 3, 3, 3], 3),
    "boundary": ([48, 49, 48, 64], [3, 3, 3, 3], 2),
    "all_boundary": ([32, 32, 32], [2, 2, 2], 1),
    "some_rows_share_more": ([40, 50, 35, 60], [2, 2, 1, 2], 1),
    "one_row_shares_nothing": ([40, 50, 35, 60], [2, 0, 2, 2], 0),
}
GQA = pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])


@pytest.mark.parametrize("scenario", SCENARIOS)
@GQA
def test_matches_reference_with_shared_prefix(scenario, num_heads, num_kv_heads):
    lengths, shared, expected_shared = SCENARIOS[scenario]
    batch = make_shared_decode_batch(lengths, shared, num_heads, num_kv_heads, head_dim=64)
    assert shared_prefix_blocks(batch["block_tables"], batch["seq_lens"], BLOCK_SIZE) == expected_shared
    assert_kernel_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@GQA
def test_dtypes_and_head_dims(dtype, head_dim, num_heads, num_kv_heads):
    lengths, shared, _ = SCENARIOS["several_blocks"]
    assert_kernel_matches_reference(make_shared_decode_batch(lengths, shared, num_heads, num_kv_heads, head_dim,
                                                             dtype=dtype, seed=1))


def test_peaked_scores_on_either_side():
    """Large queries make each softmax nearly one-hot, so one side's weight exp(m_side - m) underflows to 0."""
    lengths, shared, _ = SCENARIOS["several_blocks"]
    batch = make_shared_decode_batch(lengths, shared, 6, 2, head_dim=64, seed=2)
    batch["query"] *= 40
    assert_kernel_matches_reference(batch)


def test_sliding_window_with_shared_prefix():
    """A window falls back to the padded path; shared blocks must not change what the window sees."""
    lengths, shared, _ = SCENARIOS["several_blocks"]
    batch = make_shared_decode_batch(lengths, shared, 6, 2, head_dim=64)
    batch["sliding_window"] = 20
    windowed = assert_kernel_matches_reference(batch)
    batch["sliding_window"] = -1
    assert not torch.allclose(windowed, assert_kernel_matches_reference(batch))


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("inf"), 1e30])
@pytest.mark.parametrize("scenario", ["several_blocks", "boundary"])
def test_garbage_in_unwritten_slots_changes_nothing(fill, scenario):
    lengths, shared, _ = SCENARIOS[scenario]
    clean = make_shared_decode_batch(lengths, shared, 6, 2, head_dim=64, pool_fill=0.0)
    dirty = make_shared_decode_batch(lengths, shared, 6, 2, head_dim=64, pool_fill=fill)
    assert shared_prefix_blocks(dirty["block_tables"], dirty["seq_lens"], BLOCK_SIZE) > 0
    expected = reference_op(**copy_batch(clean))
    output = torch_kernel(**dirty)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("garbage", [-1, 2**30])
@pytest.mark.parametrize("scenario", ["several_blocks", "boundary", "all_boundary"])
def test_unused_block_table_entries_are_not_read(garbage, scenario):
    lengths, shared, expected_shared = SCENARIOS[scenario]
    batch = make_shared_decode_batch(lengths, shared, 6, 2, head_dim=64)
    used = (batch["seq_lens"].long() + BLOCK_SIZE - 1) // BLOCK_SIZE
    unused = torch.arange(batch["block_tables"].shape[1]).unsqueeze(0) >= used.unsqueeze(1)
    expected = reference_op(**copy_batch(batch))
    batch["block_tables"] = batch["block_tables"].masked_fill(unused, garbage)
    assert shared_prefix_blocks(batch["block_tables"], batch["seq_lens"], BLOCK_SIZE) == expected_shared
    torch.testing.assert_close(torch_kernel(**batch), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("table", "lengths", "expected"), [
    ([[5, 7, 9, 1], [5, 7, 9, 2]], [64, 64], 3),
    ([[5, 7, 9, 1], [5, 8, 9, 2]], [64, 64], 1),  # a later match after a mismatch is not a common prefix
    ([[5, 7, 9, 1], [6, 7, 9, 2]], [64, 64], 0),
    ([[5, 7, 9, 1], [5, 7, 9, 1]], [64, 64], 3),  # the newest token's block stays each sequence's own
    ([[5, 7, 9, 1], [5, 7, 9, 1]], [49, 64], 3),
    ([[5, 7, -1, -1], [5, 7, 9, 2**30]], [32, 64], 1),
    ([[5, -1, -1, -1], [5, 7, 9, 1]], [16, 64], 0),
    ([[5, -1, -1, -1], [5, 7, 9, 1]], [1, 64], 0),
    ([[5, 7, 9, 1], [5, 7, 9, 1], [5, 7, 4, 1]], [64, 64, 64], 2),
])
def test_shared_prefix_blocks(table, lengths, expected):
    block_tables = torch.tensor(table, dtype=torch.int32)
    assert shared_prefix_blocks(block_tables, torch.tensor(lengths, dtype=torch.int32), BLOCK_SIZE) == expected


def unshared_copy(batch: dict, num_shared: int) -> dict:
    """The same batch with every row but the first reading private copies of the shared blocks."""
    copied = copy_batch(batch)
    rows = copied["block_tables"].shape[0]
    shared_ids = copied["block_tables"][0, :num_shared].long()
    for name in ("key_cache", "value_cache"):
        copied[name] = torch.cat([copied[name]] + [copied[name][shared_ids]] * (rows - 1))
    first_new = batch["key_cache"].shape[0]
    for row in range(1, rows):
        start = first_new + (row - 1) * num_shared
        copied["block_tables"][row, :num_shared] = torch.arange(start, start + num_shared, dtype=torch.int32)
    return copied


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_results_do_not_depend_on_block_sharing(dtype):
    """bf16/fp16 keep the single SDPA pass (Hugging Face's kernel): sharing blocks changes no bit there."""
    lengths, shared, expected_shared = SCENARIOS["several_blocks"]
    batch = make_shared_decode_batch(lengths, shared, 6, 2, head_dim=64, dtype=dtype, seed=3)
    private = unshared_copy(batch, expected_shared)
    assert shared_prefix_blocks(private["block_tables"], private["seq_lens"], BLOCK_SIZE) == 0
    assert torch.equal(torch_kernel(**copy_batch(batch)), torch_kernel(**private))


def test_float32_cascade_equals_the_unshared_computation_closely():
    lengths, shared, expected_shared = SCENARIOS["several_blocks"]
    batch = make_shared_decode_batch(lengths, shared, 6, 2, head_dim=64, seed=3)
    private = unshared_copy(batch, expected_shared)
    torch.testing.assert_close(torch_kernel(**copy_batch(batch)), torch_kernel(**private), atol=2e-6, rtol=2e-6)
