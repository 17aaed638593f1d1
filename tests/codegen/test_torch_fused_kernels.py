"""The torch backend's kernels for the fused ops equal the ops' reference implementations bit for bit.

The kernels reorder nothing but update their own intermediates in place, so
they are compared on contiguous and strided inputs (as fuse_qkv's split
leaves them), single-token and multi-token shapes, float32 and bfloat16, and
must never write into their inputs.
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.torch_backend import KERNELS
from octavo.ir.ops.activation import silu_and_mul_reference
from octavo.ir.ops.fused_pointwise import Reference, encode_program
from octavo.ir.ops.norm import fused_add_rms_norm_reference, rms_norm_reference
from octavo.ir.ops.rotary import rotary_embedding_reference
from tests.ir.test_fused_pointwise_ops import rms_norm_program

octavo = torch.ops.octavo
DTYPES = [torch.float32, torch.bfloat16]


def strided_rows(tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A [1, tokens, width] view whose rows are spaced wider than `width` (a split of a merged linear)."""
    merged = (torch.randn(1, tokens, width + 24) * 2).to(dtype)
    return merged[..., 8:8 + width]


def assert_same_and_inputs_untouched(kernel, reference, *inputs):
    saved = [tensor.clone() if isinstance(tensor, torch.Tensor) else tensor for tensor in inputs]
    result, expected = kernel(*inputs), reference(*inputs)
    results = result if isinstance(result, tuple) else (result,)
    expectations = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(results, expectations, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    for before, after in zip(saved, inputs, strict=True):
        if isinstance(before, torch.Tensor):
            assert torch.equal(before, after), "a kernel wrote into its input"


def test_every_octavo_op_has_a_torch_kernel():
    registered = {getattr(octavo, name).default for name in
                  ("paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                   "fused_pointwise")}
    assert registered <= set(KERNELS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_kernel(dtype, tokens, strided):
    x = strided_rows(tokens, 64, dtype) if strided else torch.randn(1, tokens, 64).to(dtype)
    weight = torch.rand(64).to(dtype) + 0.5
    assert_same_and_inputs_untouched(KERNELS[octavo.rms_norm.default], rms_norm_reference, x, weight, 1e-5)


def test_rms_norm_kernel_with_a_weight_of_another_dtype():
    x, weight = torch.randn(1, 5, 64).to(torch.bfloat16), torch.rand(64)
    assert_same_and_inputs_untouched(KERNELS[octavo.rms_norm.default], rms_norm_reference, x, weight, 1e-6)


def test_rms_norm_kernel_per_head_like_qwen3():
    x = strided_rows(6, 64, torch.bfloat16).view(1, 6, 4, 16)
    weight = torch.rand(16).to(torch.bfloat16)
    assert_same_and_inputs_untouched(KERNELS[octavo.rms_norm.default], rms_norm_reference, x, weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 13])
def test_fused_add_rms_norm_kernel(dtype, tokens):
    x, residual = torch.randn(1, tokens, 64).to(dtype), torch.randn(1, tokens, 64).to(dtype)
    weight = torch.rand(64).to(dtype)
    assert_same_and_inputs_untouched(KERNELS[octavo.fused_add_rms_norm.default], fused_add_rms_norm_reference,
                                     x, residual, weight, 1e-6)


@pytest.mark.parametrize("cache_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 9])
def test_rotary_embedding_kernel(dtype, tokens, cache_dtype):
    # q and k as fuse_qkv leaves them: views of one merged projection, transposed to [1, heads, T, D].
    merged = torch.randn(1, tokens, (4 + 2 + 2) * 16).to(dtype)
    query = merged[..., :64].view(1, tokens, 4, 16).transpose(1, 2)
    key = merged[..., 64:96].view(1, tokens, 2, 16).transpose(1, 2)
    cache = torch.randn(50, 2, 16).to(cache_dtype or dtype)
    positions = torch.randint(0, 50, (tokens,))
    assert_same_and_inputs_untouched(KERNELS[octavo.rotary_embedding.default], rotary_embedding_reference,
                                     query, key, positions, cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 21])
@pytest.mark.parametrize("intermediate", [128, 37])
def test_silu_and_mul_kernel(dtype, tokens, intermediate):
    x = (torch.randn(1, tokens, 2 * intermediate) * 3).to(dtype)
    assert_same_and_inputs_untouched(KERNELS[octavo.silu_and_mul.default], silu_and_mul_reference, x)


def rope_program() -> str:
    """query * cos + rotated * sin, as fuse_pointwise leaves a RoPE application it fused."""
    return encode_program([
        {"op": "aten.mul.Tensor", "args": [Reference("input", 0), Reference("input", 1)]},
        {"op": "aten.mul.Tensor", "args": [Reference("input", 2), Reference("input", 3)]},
        {"op": "aten.add.Tensor", "args": [Reference("step", 0), Reference("step", 1)]},
    ])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_pointwise_kernel_computes_the_program_as_plain_torch_does(dtype):
    """The expected values are the program's ops written out as eager torch code, not the interpreter."""
    run = KERNELS[octavo.fused_pointwise.default]
    query = torch.randn(1, 7, 4, 16).to(dtype).transpose(1, 2)
    cos, sin = torch.randn(2, 1, 1, 7, 16).to(dtype)
    rotated = torch.randn(1, 4, 7, 16).to(dtype)
    assert_same_and_inputs_untouched(lambda *inputs: run(list(inputs), rope_program()),
                                     lambda q, c, r, s: q * c + r * s, query, cos, rotated, sin)

    def rms_norm_eager(x, weight):
        hidden = x.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * hidden.to(dtype)

    x, weight = strided_rows(5, 64, dtype), torch.rand(64).to(dtype) + 0.5
    assert_same_and_inputs_untouched(lambda *inputs: run(list(inputs), rms_norm_program(dtype)), rms_norm_eager,
                                     x, weight)
