"""Triton paged attention (cache write + decode + prefill kernels) against the op's definition."""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import assert_close_for_dtype, make_paged_batch

from octavo.codegen.triton_backend.paged_attention import paged_attention
from octavo.ir.ops.attention import paged_attention as reference_paged_attention

# (query_lens, seq_lens, block_size): decodes, whole prefills and prefill chunks over cached context.
MIXED = ([1, 5, 1, 9, 1], [9, 20, 31, 9, 1], 8)

EDGE_CASES = {
    # name: (query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, sliding_window)
    "one-token-prompt": ([1], [1], 16, 4, 4, 64, torch.float32, -1),
    "prefill-ends-on-and-past-block": ([16, 17], [16, 17], 16, 6, 2, 64, torch.float32, -1),
    "decode-ends-on-and-past-block": ([1, 1, 1], [16, 17, 33], 16, 8, 1, 128, torch.bfloat16, -1),
    "chunk-ends-on-and-past-block": ([8, 9], [16, 25], 8, 3, 3, 64, torch.float32, -1),
    "prefill-longer-than-tile": ([40, 1], [45, 50], 16, 2, 1, 64, torch.float32, -1),
    "sliding-window": ([1, 12, 1], [30, 40, 5], 8, 4, 2, 64, torch.float32, 8),
    "sliding-window-bf16": ([20, 1], [20, 24], 4, 6, 2, 64, torch.bfloat16, 6),
}


def run_both(batch, scale: float, sliding_window: int, soft_cap: float = 0.0):
    reference_keys, reference_values = batch.key_cache.clone(), batch.value_cache.clone()
    expected = reference_paged_attention(*batch.args(reference_keys, reference_values), scale, sliding_window,
                                         soft_cap=soft_cap)
    actual = paged_attention(*batch.args(), scale, sliding_window, soft_cap=soft_cap)
    return actual, expected, (reference_keys, reference_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8], ids=["gqa1", "gqa3", "gqa8"])
def test_mixed_batch_matches_definition(group, head_dim, dtype, device):
    query_lens, seq_lens, block_size = MIXED
    num_kv_heads = 2 if group < 8 else 1
    batch = make_paged_batch(query_lens, seq_lens, group * num_kv_heads, num_kv_heads, head_dim, block_size,
                             dtype, device, seed=group * head_dim)
    actual, expected, (keys, values) = run_both(batch, head_dim ** -0.5, -1)
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert_close_for_dtype(actual, expected, dtype)
    torch.testing.assert_close(batch.key_cache, keys, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.value_cache, values, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_edge_cases_match_definition(case, device):
    query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, window = EDGE_CASES[case]
    batch = make_paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
    actual, expected, (keys, values) = run_both(batch, 0.7 * head_dim ** -0.5, window)
    assert not actual.isnan().any()
    assert_close_for_dtype(actual, expected, dtype)
    torch.testing.assert_close(batch.key_cache, keys, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.value_cache, values, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("window", [-1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_soft_capped_scores_match_definition(dtype, window, device):
    """Gemma 2's cap on decodes, prefills and chunks: 1.5 bends scores that spread over about +-3."""
    query_lens, seq_lens, block_size = MIXED
    batch = make_paged_batch(query_lens, seq_lens, 6, 2, 64, block_size, dtype, device, seed=5)
    actual, expected, _ = run_both(batch, 64 ** -0.5, window, soft_cap=1.5)
    assert_close_for_dtype(actual, expected, dtype)
    uncapped = reference_paged_attention(*batch.args(batch.key_cache.clone(), batch.value_cache.clone()),
                                         64 ** -0.5, window)
    assert not torch.allclose(uncapped.float(), expected.float(), atol=0.05)


def test_padding_tokens_are_neither_cached_nor_attended(device):
    batch = make_paged_batch([3, 1], [3, 10], 4, 2, 64, 4, torch.float32, device, padding_tokens=2)
    untouched = batch.key_cache.clone()
    actual, expected, (keys, _) = run_both(batch, 0.125, -1)
    num_real = int(batch.query_start_loc[-1])
    assert_close_for_dtype(actual[:num_real], expected[:num_real], torch.float32)
    torch.testing.assert_close(batch.key_cache, keys, rtol=0, atol=0, equal_nan=True)
    # Exactly the 4 real tokens' slots changed: the padding tokens' keys were not written anywhere.
    changed = (batch.key_cache.nan_to_num(7.0) != untouched.nan_to_num(7.0)).any(dim=(2, 3)).sum()
    assert int(changed) == 4


def test_decode_reads_keys_through_the_block_table(device):
    # Same context, other physical blocks: the result must not change (only the table moved).
    batch = make_paged_batch([1, 1], [20, 7], 4, 2, 64, 4, torch.float32, device, seed=3)
    first = paged_attention(*batch.args(), 0.125, -1)
    permutation = torch.randperm(batch.key_cache.shape[0], generator=torch.Generator().manual_seed(5))
    inverse = torch.argsort(permutation).to(device)
    moved_keys, moved_values = batch.key_cache[permutation.to(device)], batch.value_cache[permutation.to(device)]
    moved_tables = inverse[batch.block_tables.long()].to(torch.int32)
    block_size = batch.key_cache.shape[1]
    moved_slots = inverse[batch.slot_mapping // block_size] * block_size + batch.slot_mapping % block_size
    second = paged_attention(batch.query, batch.key, batch.value, moved_keys, moved_values, moved_slots, moved_tables,
                             batch.seq_lens, batch.query_start_loc, 0.125, -1)
    torch.testing.assert_close(first, second, rtol=1e-6, atol=1e-6)
