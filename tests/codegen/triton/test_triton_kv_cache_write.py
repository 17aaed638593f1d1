"""Triton KV cache write against the definition (octavo.ir.ops.attention, step 1)."""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.triton_backend.kv_cache_write import write_kv_cache
from octavo.ir.ops.attention import _write_kv_cache as reference_write_kv_cache

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("dtype", "cache_dtype"), DTYPES, ids=["fp32", "bf16", "fp32-to-bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_writes_slots_and_skips_negative_ones(dtype, cache_dtype, head_dim, device):
    generator = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_kv_heads = 5, 4, 3
    # Slots: a block's first and last offsets, a block boundary, and two padding tokens (-1).
    slots = torch.tensor([0, 3, 4, -1, 7, 19, -1, 12], dtype=torch.int64)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    expected_keys, expected_values = cache.clone(), cache.clone()
    reference_write_kv_cache(key, value, expected_keys, expected_values, slots)
    keys, values = cache.clone().to(device), cache.clone().to(device)
    write_kv_cache(key.to(device), value.to(device), keys, values, slots.to(device))
    torch.testing.assert_close(keys.cpu(), expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(values.cpu(), expected_values, rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(keys.cpu().view(-1, num_kv_heads, head_dim)[untouched],
                       cache.view(-1, num_kv_heads, head_dim)[untouched])


def test_strided_key_and_value(device):
    # key/value as views of a fused qkv projection: rows are strided, not contiguous.
    num_tokens, num_kv_heads, head_dim = 3, 2, 64
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([5, 0, 2])
    cache = torch.zeros(2, 4, num_kv_heads, head_dim)
    expected_keys, expected_values = cache.clone(), cache.clone()
    reference_write_kv_cache(key, value, expected_keys, expected_values, slots)
    keys, values = cache.clone().to(device), cache.clone().to(device)
    write_kv_cache(key.to(device), value.to(device), keys, values, slots.to(device))
    assert torch.equal(keys.cpu(), expected_keys) and torch.equal(values.cpu(), expected_values)


def test_more_tokens_than_one_program_takes(device):
    generator = torch.Generator().manual_seed(9)
    num_tokens, num_kv_heads, head_dim, block_size = 300, 2, 64, 16
    slots = torch.randperm(20 * block_size, generator=generator)[:num_tokens]
    slots[::7] = -1
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    cache = torch.zeros(20, block_size, num_kv_heads, head_dim)
    expected_keys, expected_values = cache.clone(), cache.clone()
    reference_write_kv_cache(key, value, expected_keys, expected_values, slots)
    keys, values = cache.clone().to(device), cache.clone().to(device)
    write_kv_cache(key.to(device), value.to(device), keys, values, slots.to(device))
    assert torch.equal(keys.cpu(), expected_keys) and torch.equal(values.cpu(), expected_values)
