"""Triton silu_and_mul / gelu_and_mul against their definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_test_utils import assert_close_for_dtype

from octavo.codegen.triton_backend.activation import gelu_and_mul, silu_and_mul
from octavo.ir.ops.activation import silu_and_mul_reference

# [1, T, 2I]: a decode token, a few tokens, an intermediate size that is no power of two (SmolLM2's 1536),
# more rows than one program takes.
SHAPES = [(1, 1, 128), (1, 5, 3072), (2, 3, 200), (1, 40, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, shape)) for shape in SHAPES])
def test_silu_and_mul(shape, dtype, device):
    x = (2 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype)
    actual = silu_and_mul(x.to(device))
    expected = silu_and_mul_reference(x)
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert_close_for_dtype(actual, expected, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gelu_and_mul(approximate, dtype, device):
    x = (2 * torch.randn(1, 4, 96, generator=torch.Generator().manual_seed(1))).to(dtype)
    actual = gelu_and_mul(x.to(device), approximate)
    expected = F.gelu(x[..., :48], approximate=approximate) * x[..., 48:]
    assert_close_for_dtype(actual, expected, dtype)
