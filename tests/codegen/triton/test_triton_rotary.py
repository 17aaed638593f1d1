"""Triton rotary_embedding against the op's definition (octavo.ir.ops.rotary)."""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import assert_close_for_dtype

from octavo.codegen.triton_backend.rotary import rotary_embedding
from octavo.ir.ops.rotary import rotary_embedding_reference


def cos_sin_cache(max_positions: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[max_positions, 2, D] as HF's default rotary module computes it (base 10000)."""
    inverse_frequency = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions).float(), inverse_frequency)
    embedding = torch.cat([angles, angles], dim=-1)
    return torch.stack([embedding.cos(), embedding.sin()], dim=1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
                         [(1, 4, 4, 64), (6, 6, 2, 64), (5, 8, 1, 128), (3, 3, 1, 16), (130, 8, 2, 64)])
def test_rotary_embedding(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device):
    generator = torch.Generator().manual_seed(num_tokens * head_dim)
    # The traced layout: [1, T, H, D] projections transposed to [1, H, T, D] (non-contiguous views).
    query = torch.randn(1, num_tokens, num_heads, head_dim, generator=generator).to(dtype).transpose(1, 2)
    key = torch.randn(1, num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype).transpose(1, 2)
    positions = torch.randint(0, 100, (num_tokens,), generator=generator)
    cache = cos_sin_cache(100, head_dim, dtype)
    expected_query, expected_key = rotary_embedding_reference(query, key, positions, cache)
    actual_query, actual_key = rotary_embedding(query.to(device), key.to(device), positions.to(device),
                                                cache.to(device))
    assert actual_query.shape == expected_query.shape and actual_query.dtype == dtype
    assert_close_for_dtype(actual_query, expected_query, dtype)
    assert_close_for_dtype(actual_key, expected_key, dtype)


def test_partial_rotary_rotates_the_first_dims_of_each_head(device):
    """Phi-4-mini's form: the rotary dims are a slice of each head (a strided view), the cache that narrow."""
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(1, 5, 4, 16, generator=generator).transpose(1, 2)
    key = torch.randn(1, 5, 2, 16, generator=generator).transpose(1, 2)
    positions = torch.tensor([0, 3, 7, 8, 30])
    cache = cos_sin_cache(40, 12, torch.float32)
    expected = rotary_embedding_reference(query[..., :12], key[..., :12], positions, cache)
    actual = rotary_embedding(query[..., :12].to(device), key[..., :12].to(device), positions.to(device),
                              cache.to(device))
    for rotated, reference in zip(actual, expected, strict=True):
        assert rotated.shape == reference.shape
        assert_close_for_dtype(rotated, reference, torch.float32)


def test_inputs_are_not_modified(device):
    query = torch.randn(1, 2, 3, 64, device=device)
    key = torch.randn(1, 1, 3, 64, device=device)
    before = query.clone(), key.clone()
    rotary_embedding(query, key, torch.tensor([0, 1, 2], device=device), cos_sin_cache(8, 64, torch.float32).to(device))
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])
