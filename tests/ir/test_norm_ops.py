"""octavo.rms_norm and octavo.fused_add_rms_norm against transformers' own LlamaRMSNorm, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import octavo.ir  # registers the ops

octavo = torch.ops.octavo
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 64), (1, 7, 576), (1, 5, 4, 16), (3, 33)]  # decode row, prefill, Qwen3 per-head, plain 2-D


def hf_norm(hidden_size: int, dtype: torch.dtype, eps: float = 1e-5, seed: int = 0) -> LlamaRMSNorm:
    torch.manual_seed(seed)
    norm = LlamaRMSNorm(hidden_size, eps=eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_equals_llama_rms_norm_bitwise(shape, dtype):
    norm = hf_norm(shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        expected = norm(x)
    result = octavo.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    assert result.dtype == expected.dtype and result.shape == expected.shape
    assert torch.equal(result, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_equals_add_then_llama_rms_norm(shape, dtype):
    norm = hf_norm(shape[-1], dtype, eps=1e-6)
    x, residual = (torch.randn(shape) * 2).to(dtype), torch.randn(shape).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = octavo.fused_add_rms_norm(x, residual, norm.weight.detach(), 1e-6)
    with torch.no_grad():
        expected_residual = residual + x
        expected = norm(expected_residual)
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(normed, expected)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be written"


def test_rms_norm_with_float32_weight_on_bfloat16_input_promotes_like_hf():
    norm = hf_norm(64, torch.float32)  # weight kept in float32, as some checkpoints do
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    with torch.no_grad():
        expected = norm(x)
    result = octavo.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    assert result.dtype == torch.float32 and torch.equal(result, expected)


@pytest.mark.parametrize(("x_dtype", "weight_dtype"), [(torch.bfloat16, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
@pytest.mark.parametrize("in_float32", [False, True])
def test_fake_impls_give_the_real_shapes_and_dtypes(x_dtype, weight_dtype, in_float32):
    x, weight = torch.randn(1, 5, 32).to(x_dtype), torch.rand(32).to(weight_dtype)
    real_norm = octavo.rms_norm(x, weight, 1e-6, in_float32)
    real_fused = octavo.fused_add_rms_norm(x, x, weight, 1e-6, in_float32)
    with FakeTensorMode() as mode:
        fake_x, fake_weight = mode.from_tensor(x), mode.from_tensor(weight)
        fake_norm = octavo.rms_norm(fake_x, fake_weight, 1e-6, in_float32)
        fake_fused = octavo.fused_add_rms_norm(fake_x, fake_x, fake_weight, 1e-6, in_float32)
    for real, fake in [(real_norm, fake_norm), *zip(real_fused, fake_fused, strict=True)]:
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_schemas_follow_the_op_contract():
    assert str(octavo.rms_norm.default._schema) == (
        "octavo::rms_norm(Tensor x, Tensor weight, float eps, bool multiply_in_float32=False) -> Tensor")
    assert str(octavo.fused_add_rms_norm.default._schema) == (
        "octavo::fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, "
        "bool multiply_in_float32=False) -> (Tensor, Tensor)")


def gemma_norm(hidden_size: int, dtype: torch.dtype, eps: float = 1e-6):
    """transformers' Gemma RMSNorm ((1 + w), multiplied in float32) with weights around 0, as Gemma stores them."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    torch.manual_seed(1)
    norm = Gemma2RMSNorm(hidden_size, eps=eps)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    return norm.to(dtype)


def olmo2_norm(hidden_size: int, dtype: torch.dtype, eps: float = 1e-6):
    """transformers' OLMo 2 RMSNorm (w * x̂ in float32, then the cast back)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    torch.manual_seed(2)
    norm = Olmo2RMSNorm(hidden_size, eps=eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_multiplied_in_float32_equals_gemma_norm_with_its_offset_weight(shape, dtype):
    norm = gemma_norm(shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        expected = norm(x)
    offset_weight = norm.weight.detach().float() + 1.0  # what fuse_rms_norm folds (1 + w) into
    result = octavo.rms_norm(x, offset_weight, norm.eps, True)
    assert result.dtype == expected.dtype == dtype
    assert torch.equal(result, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_multiplied_in_float32_equals_olmo2_norm(shape, dtype):
    norm = olmo2_norm(shape[-1], dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        expected = norm(x)
    result = octavo.rms_norm(x, norm.weight.detach(), norm.variance_epsilon, True)
    assert torch.equal(result, expected)
    normed, new_residual = octavo.fused_add_rms_norm(x, x * 0.5, norm.weight.detach(), norm.variance_epsilon, True)
    with torch.no_grad():
        assert torch.equal(normed, norm(x * 0.5 + x)) and torch.equal(new_residual, x * 0.5 + x)


def test_the_two_weight_orders_differ_in_bfloat16():
    """The flag is not cosmetic: Llama's round-then-multiply and the float32 multiply differ in bf16."""
    norm = olmo2_norm(576, torch.bfloat16)
    x = (torch.randn(1, 9, 576) * 3).to(torch.bfloat16)
    weight = norm.weight.detach()
    assert not torch.equal(octavo.rms_norm(x, weight, 1e-6, True), octavo.rms_norm(x, weight, 1e-6))
