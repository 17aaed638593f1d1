"""linear_w8's integer GEMV (gemv_int8_vnni.h): a bfloat16 / float16 model's decode rows, int8 weights with one
scale per row or per group of a multiple of 32 columns, on AMX-INT8 CPUs and for 1 to 5 rows on other AVX512_VNNI
CPUs (AVX-512 build), against the definition and (one scale per row) against the AMX-INT8 GEMM.

Its arithmetic is the AMX-INT8 GEMM's (gemm_amx_int8.h): each row of x rounded to 16-bit integers on its own step,
exact int32 sums, the same float32 steps after them; the bound is therefore the one test_cpu_linear_quantized.py
derives for that GEMM (assert_within_int8_rounding). Where the integer GEMV does not run (another CPU or build, a
float32 x, other groups, OCTAVO_CPU_W8_GEMV=float) the float32 GEMV's bound applies, but for the rows from 4 to 8 it
leaves on AVX512_BF16 CPUs, which multiply in bfloat16 (gemv_int8_dot.h) within the bfloat16 GEMM's bound. Grouped
weights have a bound of their own (assert_within_grouped_integer_rounding). On CPUs with both AMX-INT8 and
AVX512_VNNI a row's result is the same bits whether it goes through the GEMV (up to 8 rows) or the GEMM (more).
"""

from __future__ import annotations

import pytest
import torch

from octavo.ir.quantized_layout import dequantize_w8
from tests.codegen.cpu.test_cpu_linear_quantized import (
    assert_within_grouped_integer_rounding,
    assert_within_int8_rounding,
    assert_within_rounding,
    decode_rows,
    dot_w8_gemv_runs,
    int8_gemm_runs,
    integer_w8_gemv_runs,
    w8_weight,
)

# (N, K): N no multiple of the 2 or 4 weight rows a block takes; K no multiple of the 64 bytes an instruction reads
# (100, 216; 40, all of it in the last, partial read), SmolLM2's q/k/v and down shapes.
SHAPES = [(37, 100), (13, 216), (7, 40), (960, 576), (96, 1536)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda value: str(value))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_integer_gemv_within_its_rounding(rows, n, k, dtype, cpu_kernels, monkeypatch):
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "")
    x = decode_rows(rows, k, dtype, rows + n + k)
    generator = torch.Generator().manual_seed(n * k)
    bias = torch.randn(n, generator=generator)
    qweight, scales = w8_weight(n, k, k, torch.float16, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, k, True)
    if integer_w8_gemv_runs(cpu_kernels, rows):
        assert_within_int8_rounding(output, x, qweight, scales, bias)
    else:
        assert_within_rounding(output, x, dequantize_w8(qweight, scales, k), bias, w8=True,
                               bf16_gemm=dot_w8_gemv_runs(cpu_kernels, rows, k, k))
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "float")
    floating = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, k, True)
    assert_within_rounding(floating, x, dequantize_w8(qweight, scales, k), bias, w8=True)
    if integer_w8_gemv_runs(cpu_kernels, rows) and n * k >= 960 * 576:
        assert not torch.equal(output, floating), "the integer GEMV rounds x, the float32 one does not"


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda value: str(value))
def test_a_row_is_the_same_through_the_gemv_and_the_gemm(n, k, cpu_kernels, monkeypatch):
    """12 rows through the GEMM (AMX-INT8 here, else another path) and their first 1, 5 and 8 through the GEMV: the
    same bits where both are the integer kernels, else each within its own bound."""
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "")
    monkeypatch.setenv("OCTAVO_CPU_QUANTIZED_GEMM", "")
    x = decode_rows(12, k, torch.bfloat16, n + k)
    generator = torch.Generator().manual_seed(n + 7 * k)
    bias = torch.randn(n, generator=generator)
    qweight, scales = w8_weight(n, k, k, torch.float32, generator)
    gemm = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, k, True)
    for rows in (1, 5, 8):
        gemv = torch.ops.octavo_cpu.linear_w8(x[:rows], qweight, scales, bias, k, True)
        if integer_w8_gemv_runs(cpu_kernels, rows) and int8_gemm_runs(cpu_kernels):
            assert torch.equal(gemv, gemm[:rows])
        elif integer_w8_gemv_runs(cpu_kernels, rows):
            assert_within_int8_rounding(gemv, x[:rows], qweight, scales, bias)
        else:
            assert_within_rounding(gemv, x[:rows], dequantize_w8(qweight, scales, k), bias, w8=True,
                                   bf16_gemm=dot_w8_gemv_runs(cpu_kernels, rows, k, k))


# (N, K, group size): groups of 32 (GGUF's Q8_0, the w4 artifacts' embedding and lm_head) and 64; K = 200 ends
# inside a group and a 64-column chunk, K = 40 inside the first chunk; groups of 96 span chunks.
GROUPED_SHAPES = [(37, 200, 32), (11, 40, 32), (960, 576, 32), (96, 1536, 64), (29, 384, 96)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("n", "k", "group_size"), GROUPED_SHAPES, ids=lambda value: str(value))
@pytest.mark.parametrize(("dtype", "scale_dtype"), [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32)], ids=["bf16", "fp16", "fp32s"])
def test_grouped_integer_gemv_within_its_rounding(rows, n, k, group_size, dtype, scale_dtype, cpu_kernels,
                                                  monkeypatch):
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "")
    x = decode_rows(rows, k, dtype, rows + n + k)
    generator = torch.Generator().manual_seed(n * k + group_size)
    bias = torch.randn(n, generator=generator)
    qweight, scales = w8_weight(n, k, group_size, scale_dtype, generator)
    weight = dequantize_w8(qweight, scales, group_size)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, group_size, True)
    if integer_w8_gemv_runs(cpu_kernels, rows):
        assert_within_grouped_integer_rounding(output, x, weight, weight.abs(), 1, bias)
    else:
        assert_within_rounding(output, x, weight, bias, w8=True,
                               bf16_gemm=dot_w8_gemv_runs(cpu_kernels, rows, group_size, k))
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "float")
    floating = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, group_size, True)
    assert_within_rounding(floating, x, weight, bias, w8=True)
    if integer_w8_gemv_runs(cpu_kernels, rows) and n * k >= 960 * 576:
        assert not torch.equal(output, floating), "the integer GEMV rounds x, the float32 one does not"


def test_the_grouped_bound_catches_a_wrong_group(cpu_kernels, monkeypatch):
    """The bound is no blanket: against a definition with the scales of two groups swapped, the same output fails
    it."""
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "")
    generator = torch.Generator().manual_seed(9)
    qweight, scales = w8_weight(64, 576, 32, torch.float16, generator)
    x = decode_rows(2, 576, torch.bfloat16, 9)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 32, True)
    weight = dequantize_w8(qweight, scales, 32)
    assert_within_grouped_integer_rounding(output, x, weight, weight.abs(), 1, None)
    swapped = scales.clone()
    swapped[:, [4, 5]] = scales[:, [5, 4]]
    wrong = dequantize_w8(qweight, swapped, 32)
    with pytest.raises(AssertionError, match="max error"):
        assert_within_grouped_integer_rounding(output, x, wrong, wrong.abs(), 1, None)


def test_float32_rows_and_other_groups_keep_the_float32_gemv(cpu_kernels, monkeypatch):
    """A float32 x (a float32 model's decode) and groups of no multiple of 32 columns never take the integer GEMV:
    their results are the float32 GEMV's bits."""
    generator = torch.Generator().manual_seed(5)
    qweight, scales = w8_weight(96, 576, 576, torch.float16, generator)
    grouped_q, grouped_scales = w8_weight(96, 576, 48, torch.float16, generator)
    x32 = torch.randn(3, 576, generator=generator)
    results = {}
    for choice in ("", "float"):
        monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", choice)
        results[choice] = (torch.ops.octavo_cpu.linear_w8(x32, qweight, scales, None, 576, True),
                           torch.ops.octavo_cpu.linear_w8(x32.bfloat16(), grouped_q, grouped_scales, None, 48, True))
    for default, floating in zip(results[""], results["float"], strict=True):
        assert torch.equal(default, floating)


def test_rows_of_zeros_and_non_finite_values(cpu_kernels, monkeypatch):
    """A row of zeros gives the bias (rounded to the row's dtype); a NaN or an infinity makes that row's outputs
    non-finite, never finite numbers from saturated integers; the other rows are unaffected."""
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "")
    generator = torch.Generator().manual_seed(22)
    x = torch.randn(6, 128, generator=generator).bfloat16()
    x[1] = 0.0
    x[3, 7] = float("nan")
    x[4, 100] = float("inf")
    bias = torch.randn(40, generator=generator)
    qweight, scales = w8_weight(40, 128, 128, torch.float32, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, 128, True)
    assert torch.equal(output[1], bias.bfloat16())
    assert not output[3].isfinite().any() and not output[4].isfinite().any()
    assert output[[0, 2, 5]].isfinite().all()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_non_finite_group_scale_stays_in_its_own_output(rows, cpu_kernels, monkeypatch):
    """A weight row with an infinite or NaN group scale makes its own output non-finite and no other: the grouped
    integer GEMV (CPUs with AMX-INT8) widens a block's rows' scales side by side, the float32 GEMV (the others)
    reads each scale where it lies; either way a row never reads its neighbour's."""
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "")
    generator = torch.Generator().manual_seed(24)
    x = decode_rows(rows, 200, torch.bfloat16, 24)
    qweight, scales = w8_weight(12, 200, 32, torch.float16, generator)
    scales[2, -1] = float("inf")
    scales[7, 0] = float("nan")
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 32, True)
    others = [n for n in range(12) if n not in (2, 7)]
    assert not output[:, [2, 7]].isfinite().any()
    assert output[:, others].isfinite().all()
    reference = torch.ops.octavo_cpu.linear_w8(x, qweight[others], scales[others], None, 32, True)
    assert torch.equal(output[:, others], reference), "a row's output does not depend on its neighbours"


def test_a_bad_choice_is_refused(cpu_kernels, monkeypatch):
    generator = torch.Generator().manual_seed(6)
    qweight, scales = w8_weight(8, 64, 64, torch.float32, generator)
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "integer")
    with pytest.raises(RuntimeError, match="OCTAVO_CPU_W8_GEMV must be float"):
        torch.ops.octavo_cpu.linear_w8(torch.randn(1, 64).bfloat16(), qweight, scales, None, 64, True)
