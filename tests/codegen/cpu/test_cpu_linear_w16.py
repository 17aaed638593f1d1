"""The C++ linear_w16 (16-bit weights widened in the kernel, float32 compute) against the op's definition.

Both the kernel and the definition sum K float32 products, in different orders, so each is within
gamma_K * sum_k |x_k w_k| of the exact result (gamma_K = K u / (1 - K u), u = 2^-24): the test
allows twice that per element, the worst case of the arithmetic rather than one machine's rounding.
"""

from __future__ import annotations

import pytest
import torch

from octavo.ir.ops.linear import linear_w16 as reference_op


def assert_within_rounding(output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> None:
    expected = reference_op(x, weight, bias)
    assert output.shape == expected.shape and output.dtype == torch.float32
    k = x.shape[-1]
    unit = 2.0 ** -24
    gamma = (k + 1) * unit / (1 - (k + 1) * unit)  # +1: the bias addition
    magnitude = x.abs().double() @ weight.double().abs().T + (0 if bias is None else bias.abs().double())
    assert ((output.double() - expected.double()).abs() <= 2 * gamma * magnitude + 1e-30).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_definition(rows, dtype, cpu_kernels):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator)
    weight = (torch.randn(300, 576, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(300, generator=generator)
    assert_within_rounding(torch.ops.octavo_cpu.linear_w16(x, weight, bias), x, weight, bias)
    assert_within_rounding(torch.ops.octavo_cpu.linear_w16(x, weight), x, weight, None)


@pytest.mark.parametrize("shape", [(1, 100), (2, 3, 100), (70, 100)], ids=["row", "batched", "gemm"])
def test_odd_sizes_and_leading_dims(shape, cpu_kernels):
    """K = 100 is no multiple of a vector, N = 37 no multiple of the rows a step computes."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator)
    weight = torch.randn(37, 100, generator=generator).to(torch.bfloat16)
    output = torch.ops.octavo_cpu.linear_w16(x, weight)
    assert output.shape == (*shape[:-1], 37)
    assert_within_rounding(output.reshape(-1, 37), x.reshape(-1, 100), weight, None)


def test_bad_arguments_name_what_is_wrong(cpu_kernels):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight must be a 2-d bfloat16 or float16"):
        torch.ops.octavo_cpu.linear_w16(x, torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="does not end in 16"):
        torch.ops.octavo_cpu.linear_w16(x, torch.randn(4, 16).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias must be float32"):
        torch.ops.octavo_cpu.linear_w16(x, torch.randn(4, 8).to(torch.bfloat16), torch.randn(5))


def test_fake_kernels_describe_the_outputs(cpu_kernels):
    """opcheck: the schema's mutations and the fake (meta) kernels agree with what the C++ ops do."""
    from tests.codegen.paged_batches import make_batch

    weight = torch.randn(24, 40).to(torch.float16)
    torch.library.opcheck(torch.ops.octavo_cpu.linear_w16.default, (torch.randn(3, 40), weight),
                          test_utils=("test_schema", "test_faketensor"))
    batch = make_batch([(9, 1), (5, 5)], 4, 2, 64, cache_dtype=torch.int8)
    torch.library.opcheck(torch.ops.octavo_cpu.paged_attention.default, (), batch,
                          test_utils=("test_schema", "test_faketensor"))
