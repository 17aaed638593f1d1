"""Triton octavo.lora (shrink, then expand, per token) against the definition, with adapters mixed per token."""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import assert_close_for_dtype

from octavo.codegen.triton_backend.lora import lora
from octavo.ir.ops.lora import lora_reference

# (tokens, K, N, slots, rank): a decode token, K and N no power of two, ranks 8 and 16 (a fused qkv's 3 x 5).
SHAPES = [(1, 64, 96, 2, 8), (6, 72, 200, 4, 16), (9, 130, 48, 3, 15)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, shape)) for shape in SHAPES])
def test_lora(shape, dtype, device):
    tokens, k, n, num_slots, rank = shape
    g = torch.Generator().manual_seed(tokens)
    y, x = torch.randn(1, tokens, n, generator=g).to(dtype), torch.randn(1, tokens, k, generator=g).to(dtype)
    a = (torch.randn(num_slots, rank, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(num_slots, n, rank, generator=g).to(dtype)
    slots = torch.randint(-1, num_slots, (tokens,), generator=g)
    actual = lora(y.to(device), x.to(device), a.to(device), b.to(device), slots.to(device))
    assert actual.shape == y.shape and actual.dtype == dtype
    assert_close_for_dtype(actual, lora_reference(y, x, a, b, slots), dtype)
