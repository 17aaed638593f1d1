"""Triton rms_norm / fused_add_rms_norm against the ops' definitions (octavo.ir.ops.norm)."""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import assert_close_for_dtype

from octavo.codegen.triton_backend.norm import fused_add_rms_norm, rms_norm
from octavo.ir.ops.norm import fused_add_rms_norm_reference, rms_norm_reference

# [1, T, H] like the traced graph; T = 1 (a decode step), a few tokens, and more rows than one program takes;
# H a power of two and not (576: SmolLM2); leading dims other than [1, T].
SHAPES = [(1, 1, 64), (1, 7, 128), (1, 5, 576), (3, 2, 96), (1, 300, 128)]


def _inputs(shape, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=generator)).to(dtype)
    residual = torch.randn(shape, generator=generator).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=generator)).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, shape)) for shape in SHAPES])
def test_rms_norm(shape, dtype, device):
    x, _, weight = _inputs(shape, dtype, device)
    actual = rms_norm(x, weight, 1e-6)
    expected = rms_norm_reference(x.cpu(), weight.cpu(), 1e-6)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert_close_for_dtype(actual, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, shape)) for shape in SHAPES])
def test_fused_add_rms_norm(shape, dtype, device):
    x, residual, weight = _inputs(shape, dtype, device, seed=1)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x.cpu(), residual.cpu(), weight.cpu(), 1e-5)
    # The residual add is one rounded add in x's dtype: bitwise equal to torch's.
    assert torch.equal(new_residual.cpu(), expected_residual)
    assert_close_for_dtype(normed, expected_normed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_multiplied_in_float32(dtype, device):
    """Gemma's and OLMo 2's order: the float32 weight multiplies before the one rounding to x's dtype."""
    x, residual, weight = _inputs((1, 7, 128), dtype, device, seed=2)
    offset_weight = weight.float() + 1.0
    actual = rms_norm(x, offset_weight, 1e-6, True)
    expected = rms_norm_reference(x.cpu(), offset_weight.cpu(), 1e-6, True)
    assert actual.dtype == dtype
    assert_close_for_dtype(actual, expected, dtype)
    normed, new_residual = fused_add_rms_norm(x, residual, offset_weight, 1e-6, True)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x.cpu(), residual.cpu(), offset_weight.cpu(),
                                                                      1e-6, True)
    assert torch.equal(new_residual.cpu(), expected_residual)
    assert_close_for_dtype(normed, expected_normed, dtype)


def test_fp32_weight_on_bf16_input_gives_fp32(device):
    x, _, weight = _inputs((1, 3, 64), torch.bfloat16, device)
    actual = rms_norm(x, weight.float(), 1e-6)
    expected = rms_norm_reference(x.cpu(), weight.float().cpu(), 1e-6)
    assert actual.dtype == torch.float32
    assert_close_for_dtype(actual, expected, torch.float32)


def test_non_contiguous_input(device):
    x, _, weight = _inputs((1, 6, 64), torch.float32, device)
    strided = x.transpose(0, 1)  # [6, 1, 64], rows still unit-stride
    wide = torch.cat([x, x], dim=-1)[..., :64]  # rows of stride 128
    for tensor in (strided, wide):
        assert_close_for_dtype(rms_norm(tensor, weight, 1e-6), rms_norm_reference(tensor.cpu(), weight.cpu(), 1e-6),
                               torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eps_is_inside_the_root(dtype, device):
    # Small activations and a large eps: leaving eps out, or adding it outside the rsqrt, changes the result.
    x, residual, weight = _inputs((1, 4, 64), dtype, device, seed=2)
    x = (x.float() * 0.01).to(dtype)
    assert_close_for_dtype(rms_norm(x, weight, 0.5), rms_norm_reference(x.cpu(), weight.cpu(), 0.5), dtype)
    normed, _ = fused_add_rms_norm(x, residual, weight, 0.5)
    assert_close_for_dtype(normed, fused_add_rms_norm_reference(x.cpu(), residual.cpu(), weight.cpu(), 0.5)[0], dtype)
