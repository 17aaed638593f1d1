"""linear_w4's integer GEMV (gemv_int4_vnni.h): a bfloat16 / float16 model's decode rows, 4-bit weights in groups
of a multiple of 32 columns, on AVX512_VNNI CPUs (AVX-512 build), against the definition.

Its arithmetic: each row of x rounded to 16-bit integers on its own step s = max |x_row| / 32767 (as the AMX-INT8
GEMM rounds it), which moves each x_k by at most (0.5 + 2^-9) s + 2^-22 |x_k|; exact integer sums per 32-column
block and per group; then float32: each block's sum times its group's scale, the offsets times the groups' sums of
x, all added in float32, times s, plus the bias. So the result is, up to float32 roundings, sum_k w~_k x~_k + bias
with w~_k = q_k * scale + offset exactly and x~_k = xi_k * s. Against the definition's weights
w_k = fl(fl(q_k * scale) + offset), |w_k - w~_k| <= gamma_3 (|q_k * scale| + |offset|). The bound is
test_cpu_linear_quantized.py's assert_within_grouped_integer_rounding with those terms and 3 roundings of the
weights. Where the integer GEMV does not run (another CPU or build, a float32 x,
groups of another size, OCTAVO_CPU_W4_GEMV=float) the float32 GEMV's bound applies.
"""

from __future__ import annotations

import pytest
import torch

from octavo.ir.quantized_layout import dequantize_w4
from tests.codegen.cpu.test_cpu_linear_quantized import (
    assert_within_grouped_integer_rounding,
    assert_within_rounding,
    decode_rows,
    integer_gemv_runs,
    w4_weight,
)

# (N, K, group size): K = 200 ends inside a 32-column block and a 128-column chunk; 576 and 1536 are SmolLM2's
# (groups of 32 as GGUF's Q4_1, 64 and 128 as AWQ / GPTQ); groups of 96 span chunks; N no multiple of 4.
SHAPES = [(37, 200, 32), (13, 576, 64), (960, 576, 32), (96, 1536, 128), (29, 384, 96)]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] bytes -> [N, K] values, column 2j the low nibble of byte j."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def w4_terms(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int) -> torch.Tensor:
    """|q_k * scale| + |offset| for every weight: the magnitudes of the parts the GEMV sums exactly."""
    columns = torch.arange(2 * packed.shape[1]) // group_size
    values = unpack_int4(packed).double()
    return (values * scales.double()[:, columns]).abs() + offsets.double()[:, columns].abs()


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES, ids=lambda value: str(value))
@pytest.mark.parametrize(("dtype", "scale_dtype"), [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32)], ids=["bf16", "fp16", "fp32s"])
def test_integer_gemv_within_its_rounding(rows, n, k, group_size, dtype, scale_dtype, cpu_kernels, monkeypatch):
    monkeypatch.setenv("OCTAVO_CPU_W4_GEMV", "")
    x = decode_rows(rows, k, dtype, rows + n + k)
    generator = torch.Generator().manual_seed(n * k + group_size)
    bias = torch.randn(n, generator=generator)
    packed, scales, offsets = w4_weight(n, k, group_size, scale_dtype, generator)
    weight = dequantize_w4(packed, scales, offsets, group_size)
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, bias, group_size, True)
    if integer_gemv_runs(cpu_kernels):
        terms = w4_terms(packed, scales, offsets, group_size)
        assert_within_grouped_integer_rounding(output, x, weight, terms, 3, bias)
    else:
        assert_within_rounding(output, x, weight, bias)
    monkeypatch.setenv("OCTAVO_CPU_W4_GEMV", "float")
    floating = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, bias, group_size, True)
    assert_within_rounding(floating, x, weight, bias)
    if integer_gemv_runs(cpu_kernels) and n * k >= 960 * 576:
        assert not torch.equal(output, floating), "the integer GEMV rounds x, the float32 one does not"


def test_the_bound_is_tight_enough_to_catch_a_wrong_group(cpu_kernels, monkeypatch):
    """The bound is no blanket: weights whose scales a wrong group lookup would misapply fail it. Checked by
    asserting the bound against a definition with the scales of two groups swapped."""
    monkeypatch.setenv("OCTAVO_CPU_W4_GEMV", "")
    generator = torch.Generator().manual_seed(9)
    packed, scales, offsets = w4_weight(64, 576, 32, torch.float16, generator)
    x = decode_rows(2, 576, torch.bfloat16, 9)
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, None, 32, True)
    weight = dequantize_w4(packed, scales, offsets, 32)
    assert_within_grouped_integer_rounding(output, x, weight, w4_terms(packed, scales, offsets, 32), 3, None)
    swapped = scales.clone()
    swapped[:, [4, 5]] = scales[:, [5, 4]]
    wrong = dequantize_w4(packed, swapped, offsets, 32)
    with pytest.raises(AssertionError, match="max error"):
        assert_within_grouped_integer_rounding(output, x, wrong, w4_terms(packed, swapped, offsets, 32), 3, None)


def test_other_groups_and_float32_rows_keep_the_float32_gemv(cpu_kernels, monkeypatch):
    """Groups of no multiple of 32 columns (48, 9) and a float32 x (a float32 model's decode) never take the integer
    GEMV: their results are the float32 GEMV's bits."""
    generator = torch.Generator().manual_seed(5)
    weights = {size: w4_weight(40, 576, size, torch.float16, generator) for size in (48, 9, 32)}
    x16 = torch.randn(3, 576, generator=generator).bfloat16()
    x32 = torch.randn(3, 576, generator=generator)
    results = {}
    for choice in ("", "float"):
        monkeypatch.setenv("OCTAVO_CPU_W4_GEMV", choice)
        results[choice] = [torch.ops.octavo_cpu.linear_w4(x16, *weights[48], None, 48, True),
                           torch.ops.octavo_cpu.linear_w4(x16, *weights[9], None, 9, True),
                           torch.ops.octavo_cpu.linear_w4(x32, *weights[32], None, 32, True)]
    for default, floating in zip(results[""], results["float"], strict=True):
        assert torch.equal(default, floating)


def test_rows_of_zeros_and_non_finite_values(cpu_kernels, monkeypatch):
    """A row of zeros gives the bias (rounded to the row's dtype); a NaN or an infinity makes that row's outputs
    non-finite, never finite numbers from saturated integers; the other rows are unaffected."""
    monkeypatch.setenv("OCTAVO_CPU_W4_GEMV", "")
    generator = torch.Generator().manual_seed(22)
    x = torch.randn(6, 256, generator=generator).bfloat16()
    x[1] = 0.0
    x[3, 7] = float("nan")
    x[4, 200] = float("inf")
    bias = torch.randn(40, generator=generator)
    packed, scales, offsets = w4_weight(40, 256, 64, torch.float32, generator)
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, bias, 64, True)
    assert torch.equal(output[1], bias.bfloat16())
    assert not output[3].isfinite().any() and not output[4].isfinite().any()
    assert output[[0, 2, 5]].isfinite().all()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_non_finite_parameter_stays_in_its_own_output(rows, cpu_kernels, monkeypatch):
    """A weight row whose scale or offset is infinite or NaN makes its own output non-finite and no other: the
    GEMV widens a block's rows' parameters side by side, and a row never reads its neighbour's (K = 200 ends inside
    a 128-column chunk, so the chunk's scale vector and the last offsets vector run past the row's groups)."""
    monkeypatch.setenv("OCTAVO_CPU_W4_GEMV", "")
    generator = torch.Generator().manual_seed(23)
    x = decode_rows(rows, 200, torch.bfloat16, 23)
    packed, scales, offsets = w4_weight(12, 200, 32, torch.float16, generator)
    offsets[1, -1] = float("inf")
    scales[5, -1] = float("nan")
    offsets[10, 0] = float("-inf")
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, None, 32, True)
    broken = [1, 5, 10]
    assert not output[:, broken].isfinite().any()
    others = [n for n in range(12) if n not in broken]
    assert output[:, others].isfinite().all()
    reference = torch.ops.octavo_cpu.linear_w4(x, packed[others], scales[others], offsets[others], None, 32, True)
    assert torch.equal(output[:, others], reference), "a row's output does not depend on its neighbours"


def test_a_bad_choice_is_refused(cpu_kernels, monkeypatch):
    generator = torch.Generator().manual_seed(6)
    packed, scales, offsets = w4_weight(8, 64, 32, torch.float32, generator)
    monkeypatch.setenv("OCTAVO_CPU_W4_GEMV", "integer")
    with pytest.raises(RuntimeError, match="OCTAVO_CPU_W4_GEMV must be float"):
        torch.ops.octavo_cpu.linear_w4(torch.randn(1, 64).bfloat16(), packed, scales, offsets, None, 32, True)
