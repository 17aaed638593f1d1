"""The C++ linear_w8 / linear_w4 / linear_fp8 (weights dequantized in the kernel) against the layouts' definition.

The reference is the definition (octavo.ir.quantized_layout's float32 dequantization, then x @ W.T + bias)
computed in float64, so it is exact up to float64 rounding. Bounds follow Higham (Accuracy and Stability of
Numerical Algorithms, lemma 3.1): a result that reaches every term through at most n float32 roundings
(u = 2^-24), each a factor (1 + d) or 1 / (1 + d) with |d| <= u, is within gamma_n * sum_k |x_k w_k| + |bias|
of the exact one (gamma_n = n u / (1 - n u)); the order of the sum does not matter.

- w4, fp8, and w8 above 8 rows: each weight is dequantized exactly as the definition does (the same float32
  roundings; fp8's widening is exact), then the K products and the bias are summed in float32: one rounding
  per product and at most K additions on any term's way, n = K + 1.
- w8 GEMV (up to 8 rows; see gemv_int8.h): x * float(q) summed over each group, the sum multiplied by the
  group's scale, the groups and the bias added: a product, at most K additions and the scaling, K + 2 roundings
  of the exact x * q * scale; against the reference's weights w = fl(q * scale) = q * scale * (1 + d) one factor
  1 / (1 + d) more: n = K + 3.

A result rounded to bfloat16 / float16 (x of that dtype) adds one rounding of the output: half a unit in its
last place, 2^-8 / 2^-11 relative. With bf16_gemm (rows above the GEMV's 8), x and the weight are each rounded
to bfloat16 (unit roundoff v = 2^-8, rounding to nearest: 8 significant bits) before the float32 sum, so each
product is within (1 + v)^2 - 1 of its exact value, and oneDNN's bfloat16 result rounds once more (the AMX
kernel's float32 sum does not): the bound grows by those terms.

w8 weights with one scale per row, above 8 rows with bf16_gemm, run on AMX-INT8 where the CPU has it: each row of x
is rounded to integers on its own step s = max |x_row| / 32767, which moves each x_k by at most
s / 2 + 2^-9 s + 2^-22 |x_k|; the integer sums are exact, and the float32 steps after them (the two sums' widening
and addition, step * scale, the product, the bias) are at most 5 roundings of the whole result. Against the
reference's weights fl(q * scale) one rounding more: the bound is
(0.5 + 2^-9) s * scale * sum_k |q_k| + gamma_8 * (sum_k |x_k w_k| + |bias|), plus the output's rounding.
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.cpu_backend.isa import _linux_cpu_flags
from octavo.ir.quantized_layout import dequantize_fp8, dequantize_w4, dequantize_w8, num_groups, pack_int4

ROWS = [1, 2, 7, 8, 9, 64]
GEMV_ROWS = 8
OUTPUT_UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def w8_weight(n: int, k: int, group_size: int, scale_dtype: torch.dtype, generator: torch.Generator):
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = (torch.rand(n, num_groups(k, group_size), generator=generator) * 0.02 + 1e-3).to(scale_dtype)
    return qweight, scales


def w4_weight(n: int, k: int, group_size: int, scale_dtype: torch.dtype, generator: torch.Generator):
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    groups = num_groups(k, group_size)
    scales = (torch.rand(n, groups, generator=generator) * 0.02 + 1e-3).to(scale_dtype)
    offsets = (torch.randn(n, groups, generator=generator) * 0.1).to(scale_dtype)
    return pack_int4(values), scales, offsets


def fp8_weight(n: int, k: int, generator: torch.Generator):
    """Every float8_e4m3fn bit pattern but NaN's, at random (subnormals, both zeros and +-448 included)."""
    bits = torch.randint(0, 254, (n, k), dtype=torch.int32, generator=generator)
    bits = bits + (bits >= 0x7F).int()  # skip 0x7F, the positive NaN; 254 + 1 = 0xFF stays out of range
    qweight = bits.to(torch.uint8).view(torch.float8_e4m3fn)
    return qweight, torch.rand(n, generator=generator) * 0.02 + 1e-3


def assert_within_rounding(output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, bf16_gemm: bool = False, w8: bool = False) -> None:
    """`output` of x [..., K] against the float32 `weight` [N, K] within the bound of the module docstring.

    w8: the output is linear_w8's, from its GEMV (n = K + 3) where x has up to GEMV_ROWS rows.
    """
    flat = x.reshape(-1, x.shape[-1]).double()
    assert output.dtype == x.dtype and output.shape == (*x.shape[:-1], weight.shape[0])
    bias64 = 0 if bias is None else bias.double()
    exact = flat @ weight.double().T + bias64
    roundings = x.shape[-1] + (3 if w8 and flat.shape[0] <= GEMV_ROWS else 1)
    unit = 2.0 ** -24
    gamma = roundings * unit / (1 - roundings * unit)
    magnitude = flat.abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    if bf16_gemm:
        narrowing = 2.0 ** -8
        gamma = (1 + narrowing) ** 2 - 1 + gamma * (1 + narrowing) ** 2
        bound = gamma * magnitude + narrowing * (exact.abs() + gamma * magnitude)
        bound = bound + OUTPUT_UNIT[x.dtype] * (exact.abs() + bound) + 1e-30
    else:
        bound = gamma * magnitude + OUTPUT_UNIT[x.dtype] * (exact.abs() + gamma * magnitude) + 1e-30
    error = (output.reshape(exact.shape).double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst excess {(error - bound).max():.3g}"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size", [32, 576, 100], ids=["group32", "per_row", "group100"])
def test_w8_matches_definition(rows, group_size, cpu_kernels):
    """K = 576 (a multiple of 32, not of 100: the last group of a row is shorter), N = 203 (odd)."""
    generator = torch.Generator().manual_seed(rows * 1000 + group_size)
    qweight, scales = w8_weight(203, 576, group_size, torch.float16, generator)
    x = torch.randn(rows, 576, generator=generator)
    bias = torch.randn(203, generator=generator)
    weight = dequantize_w8(qweight, scales, group_size)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, group_size)
    assert_within_rounding(output, x, weight, bias, w8=True)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, group_size)
    assert_within_rounding(output, x, weight, None, w8=True)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("group_size", [216, 48], ids=["per_row", "group48"])
def test_w8_gemv_odd_vector_counts(rows, group_size, cpu_kernels):
    """K = 216: per row 13.5 AVX-512 vectors (27 AVX2 ones), groups of 48 three (six): chains left unequal.

    The GEMV deals a row's or a group's vectors to several accumulators in turn and sums the columns no vector
    covers apart; N = 13 leaves a block of fewer rows at the end.
    """
    generator = torch.Generator().manual_seed(rows * 100 + group_size)
    qweight, scales = w8_weight(13, 216, group_size, torch.float32, generator)
    x = torch.randn(rows, 216, generator=generator)
    bias = torch.randn(13, generator=generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, group_size)
    assert_within_rounding(output, x, dequantize_w8(qweight, scales, group_size), bias, w8=True)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_w4_matches_definition(rows, group_size, cpu_kernels):
    """K = 200: no multiple of 64 or 128 (a shorter last group) nor of a vector; N = 37 (odd)."""
    generator = torch.Generator().manual_seed(rows * 1000 + group_size)
    qweight, scales, offsets = w4_weight(37, 200, group_size, torch.float16, generator)
    x = torch.randn(rows, 200, generator=generator)
    bias = torch.randn(37, generator=generator)
    weight = dequantize_w4(qweight, scales, offsets, group_size)
    output = torch.ops.octavo_cpu.linear_w4(x, qweight, scales, offsets, bias, group_size)
    assert_within_rounding(output, x, weight, bias)
    output = torch.ops.octavo_cpu.linear_w4(x, qweight, scales, offsets, None, group_size)
    assert_within_rounding(output, x, weight, None)


@pytest.mark.parametrize("rows", ROWS)
def test_fp8_matches_definition(rows, cpu_kernels):
    """K = 200 (no multiple of a vector), N = 37 (odd): the weights stay float8 and are widened in the kernel."""
    generator = torch.Generator().manual_seed(rows)
    qweight, scales = fp8_weight(37, 200, generator)
    x = torch.randn(rows, 200, generator=generator)
    bias = torch.randn(37, generator=generator)
    weight = dequantize_fp8(qweight, scales)
    assert_within_rounding(torch.ops.octavo_cpu.linear_fp8(x, qweight, scales, bias), x, weight, bias)
    assert_within_rounding(torch.ops.octavo_cpu.linear_fp8(x, qweight, scales, None), x, weight, None)


def test_fp8_widening_is_exact_for_every_bit_pattern(cpu_kernels):
    """Identity rows of x pick single weights: the kernel's widening of each of the 254 non-NaN patterns (in
    registers in the GEMV up to 8 rows, element by element at a row's end and in the GEMM's tiles) is torch's."""
    patterns = torch.tensor([bits for bits in range(256) if bits & 0x7F != 0x7F], dtype=torch.uint8)
    qweight = torch.stack([patterns.roll(shift) for shift in range(3)]).view(torch.float8_e4m3fn)  # [3, 254]
    expected = qweight.float().T
    identity = torch.eye(254)
    for first in range(0, 254, 8):  # the GEMV, 8 rows at a time
        output = torch.ops.octavo_cpu.linear_fp8(identity[first:first + 8], qweight, torch.ones(3), None)
        assert torch.equal(output, expected[first:first + 8])  # (a sum's zero is +0.0 whatever its terms' signs)
    assert torch.equal(torch.ops.octavo_cpu.linear_fp8(identity, qweight, torch.ones(3), None), expected)
    nan = torch.full((1, 40), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.ops.octavo_cpu.linear_fp8(torch.ones(1, 40), nan, torch.ones(1), None).isnan().all()


def native_gemm_runs(cpu_kernels) -> bool:
    """Whether the rows above the GEMV's take the kernels' own GEMMs by default (AMX tiles or vdpbf16ps): the
    AVX-512 build on a CPU with AVX512_BF16."""
    return cpu_kernels.target.level == "avx512" and cpu_kernels.target.avx512_bf16


def bf16_gemm_choices(cpu_kernels) -> list[str]:
    """OCTAVO_CPU_QUANTIZED_GEMM values whose kernels differ here: the CPU's choice, oneDNN where that is not
    oneDNN, and the vdpbf16ps GEMM where the choice is AMX."""
    if not native_gemm_runs(cpu_kernels):
        return [""]
    return ["", "onednn", "dot"] if cpu_kernels.target.amx else ["", "onednn"]


# (rows, N, K, w4 group size): rows of x from one partial tile to three blocks of 32; N no multiple of a block of
# 32 weight rows; K no multiple of a tile's 32 and split into parts (1536); w4 groups that start on odd columns.
# The AMX GEMM's two orientations (few rows of x against many weights: the weights as the A operand) each take a
# partial tile of x, a partial block of weights and K in parts: (9, ...), (40, ...) and (64, 300, ...) the one, the
# rest the other. The vdpbf16ps GEMM takes the weights as rows only for whole tiles of 32 rows of x: (64, 300, ...).
GEMM_SHAPES = [(9, 300, 200, 64), (40, 300, 1536, 32), (64, 300, 1000, 64), (33, 37, 100, 9), (64, 96, 1536, 32),
               (70, 64, 576, 64)]


@pytest.mark.parametrize(("rows", "n", "k", "group_size"), GEMM_SHAPES, ids=lambda value: str(value))
def test_bf16_gemm_within_its_rounding(rows, n, k, group_size, cpu_kernels, monkeypatch):
    """bf16_gemm rounds x and the dequantized weights to bfloat16 above 8 rows (bias in float32), on AMX tiles where
    the CPU has them, vdpbf16ps on other AVX512_BF16 CPUs (and where OCTAVO_CPU_QUANTIZED_GEMM=dot asks for it),
    oneDNN's GEMM elsewhere and where OCTAVO_CPU_QUANTIZED_GEMM=onednn asks for it."""
    for choice in bf16_gemm_choices(cpu_kernels):
        monkeypatch.setenv("OCTAVO_CPU_QUANTIZED_GEMM", choice)
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, k, generator=generator)
        bias = torch.randn(n, generator=generator)
        qweight, scales = w8_weight(n, k, 32, torch.float16, generator)
        output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, 32, True)
        assert_within_rounding(output, x, dequantize_w8(qweight, scales, 32), bias, bf16_gemm=True)
        packed, scales, offsets = w4_weight(n, k, group_size, torch.float16, generator)
        output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, None, group_size, True)
        assert_within_rounding(output, x, dequantize_w4(packed, scales, offsets, group_size), None, bf16_gemm=True)
        assert not torch.equal(output, torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, None, group_size)), \
            "the bfloat16 GEMM rounds differently from the float32 one"
        qweight, scales = fp8_weight(n, k, generator)
        output = torch.ops.octavo_cpu.linear_fp8(x, qweight, scales, bias, True)
        assert_within_rounding(output, x, dequantize_fp8(qweight, scales), bias, bf16_gemm=True)


def test_bf16_gemm_rows_of_x_do_not_depend_on_the_other_rows(cpu_kernels):
    """A row's output from the AMX GEMM has the same bits in a call of 9, 32 or 40 rows as in one of 512: the few rows
    take the weights as the A operand, the many the packed weights as the B operand, and both sum the same bfloat16
    products in K's order. So does the vdpbf16ps GEMM's (every row sums its pairs in K's order, whatever rows run
    beside it). Elsewhere (oneDNN, whose blocking may change with the rows) within the rounding bound."""
    generator = torch.Generator().manual_seed(9)
    n, k = 300, 576
    x = torch.randn(512, k, generator=generator)
    qweight, scales = w8_weight(n, k, 32, torch.float16, generator)
    packed, w4_scales, offsets = w4_weight(n, k, 32, torch.bfloat16, generator)
    fp8, fp8_scales = fp8_weight(n, k, generator)
    ops = torch.ops.octavo_cpu
    calls = {"w8": (lambda rows: ops.linear_w8(rows, qweight, scales, None, 32, True),
                    dequantize_w8(qweight, scales, 32)),
             "w4": (lambda rows: ops.linear_w4(rows, packed, w4_scales, offsets, None, 32, True),
                    dequantize_w4(packed, w4_scales, offsets, 32)),
             "fp8": (lambda rows: ops.linear_fp8(rows, fp8, fp8_scales, None, True), dequantize_fp8(fp8, fp8_scales))}
    native = native_gemm_runs(cpu_kernels)
    for name, (call, weight) in calls.items():
        whole = call(x)
        for first, count in ((0, 9), (100, 40), (480, 32)):
            part = call(x[first:first + count])
            if native:
                assert torch.equal(part, whole[first:first + count]), (name, first, count)
            else:
                assert_within_rounding(part, x[first:first + count], weight, None, bf16_gemm=True)


@pytest.mark.parametrize(("rows", "n"), [(None, 40), (64, 600)], ids=["packed_weights", "weights_as_rows"])
@pytest.mark.parametrize("group_size", [32, 64, 100, 200], ids=lambda size: f"group{size}")
def test_bf16_gemm_rounds_each_dequantized_weight_once(rows, n, group_size, cpu_kernels, monkeypatch):
    """bf16_gemm multiplies each weight dequantized as its layout defines it, rounded to bfloat16 once: rows of the
    identity as x (a product with 1.0 and sums of zeros are exact in every GEMM) give back W.T rounded to bfloat16
    bit for bit, on every dequantizing path (kernels' own GEMMs in both orientations, oneDNN). K = 200 ends in a
    partial group of 32 columns and N in a partial block of 32 weight rows; every 4-bit and 8-bit value occurs in
    every column. w8 in one group of 200 is one scale per row: on AMX-INT8 CPUs its default GEMM multiplies the int8
    weights as they are (test_per_row_int8_gemm), held there to its own bound, and OCTAVO_CPU_QUANTIZED_GEMM=amx_bf16
    asks for the dequantizing GEMM this test is about."""
    k = 200
    generator = torch.Generator().manual_seed(group_size)
    x = torch.eye(k)[:rows]
    packed, scales, offsets = w4_weight(n, k, group_size, torch.float16, generator)
    expected = dequantize_w4(packed, scales, offsets, group_size).bfloat16().float().T[:rows]
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, None, group_size, True)
    assert torch.equal(output, expected)
    qweight, scales = w8_weight(n, k, group_size, torch.bfloat16, generator)
    if group_size == k and int8_gemm_runs(cpu_kernels):
        integer = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, group_size, True)
        assert_within_int8_rounding(integer, x, qweight, scales, None)
        monkeypatch.setenv("OCTAVO_CPU_QUANTIZED_GEMM", "amx_bf16")
    expected = dequantize_w8(qweight, scales, group_size).bfloat16().float().T[:rows]
    assert torch.equal(torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, group_size, True), expected)


def test_native_gemm_keeps_float32_sums_where_the_cpu_has_bf16(cpu_kernels, monkeypatch):
    """On AVX512_BF16 CPUs (AVX-512 build) the kernels' own GEMM (AMX tiles or vdpbf16ps) runs by default: its float32
    sums are not rounded to bfloat16, so they differ from oneDNN's bfloat16 results; elsewhere the variable changes
    nothing. A bad value is refused."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(40, 128, generator=generator)
    qweight, scales = w8_weight(64, 128, 128, torch.float32, generator)
    results = {}
    for choice in ("", "onednn"):
        monkeypatch.setenv("OCTAVO_CPU_QUANTIZED_GEMM", choice)
        results[choice] = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 128, True)
    onednn_is_bfloat16 = torch.equal(results["onednn"], results["onednn"].bfloat16().float())
    assert onednn_is_bfloat16
    native = native_gemm_runs(cpu_kernels)
    assert torch.equal(results[""], results["onednn"]) != native
    assert torch.equal(results[""], results[""].bfloat16().float()) != native
    monkeypatch.setenv("OCTAVO_CPU_QUANTIZED_GEMM", "mkl")
    with pytest.raises(RuntimeError, match="OCTAVO_CPU_QUANTIZED_GEMM must be onednn"):
        torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 128, True)


def int8_gemm_runs(cpu_kernels) -> bool:
    """Whether linear_w8 with one scale per row runs on AMX-INT8 above the GEMV's rows here (with bf16_gemm)."""
    target = cpu_kernels.target
    return target.level == "avx512" and target.amx and target.avx512_bf16 and target.amx_int8


def assert_within_int8_rounding(output: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                bias: torch.Tensor | None) -> None:
    """linear_w8's AMX-INT8 result against the definition, within the bound of the module docstring."""
    flat = x.reshape(-1, x.shape[-1]).double()
    weight = dequantize_w8(qweight, scales, qweight.shape[1]).double()
    bias64 = 0 if bias is None else bias.double()
    exact = flat @ weight.T + bias64
    step = flat.abs().amax(dim=1, keepdim=True) / 32767
    integer_rounding = (0.5 + 2.0 ** -9) * step * (qweight.double().abs() @ torch.ones(qweight.shape[1]).double()
                                                   * scales.double().reshape(-1)).reshape(1, -1)
    gamma = 8 * 2.0 ** -24 / (1 - 8 * 2.0 ** -24)
    magnitude = flat.abs() @ weight.abs().T + (0 if bias is None else bias.double().abs())
    bound = integer_rounding + (2.0 ** -22) * (flat.abs() @ weight.abs().T) + gamma * magnitude
    bound = bound + OUTPUT_UNIT[x.dtype] * (exact.abs() + bound) + 1e-30
    error = (output.reshape(exact.shape).double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst excess {(error - bound).max():.3g}"


def integer_gemv_runs(cpu_kernels) -> bool:
    """Whether a bfloat16 / float16 x's w4 GEMV (with bf16_gemm) sums in integers here (gemv_int4_vnni.h): the
    AVX-512 build on a CPU with AVX512_VNNI."""
    return cpu_kernels.target.level == "avx512" and "avx512_vnni" in _linux_cpu_flags()


def integer_w8_gemv_runs(cpu_kernels, rows: int) -> bool:
    """Whether the w8 GEMV of `rows` rows of x does (gemv_int8_vnni.h): the same, on a CPU with AMX-INT8 (every
    GEMV row) or, on other CPUs with AVX512_VNNI, for 1 to 5 rows."""
    return integer_gemv_runs(cpu_kernels) and (cpu_kernels.target.amx_int8 or rows <= 5)


def dot_w8_gemv_runs(cpu_kernels, rows: int, group_size: int, k: int) -> bool:
    """Whether a bfloat16 / float16 x's w8 GEMV (with bf16_gemm) multiplies in bfloat16 here (gemv_int8_dot.h): 4 to
    8 rows, one scale per row or groups of a multiple of 32 columns, where the kernels' own GEMMs run
    (native_gemm_runs) and the integer GEMV does not. Its bound is the bfloat16 GEMM's."""
    shape_fits = group_size >= k or group_size % 32 == 0
    return (4 <= rows <= GEMV_ROWS and shape_fits and native_gemm_runs(cpu_kernels)
            and not integer_w8_gemv_runs(cpu_kernels, rows))


@pytest.mark.parametrize("rows", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 200], ids=lambda size: f"group{size}")
def test_w8_gemv_of_a_bfloat16_model_rounds_each_weight_once(rows, group_size, cpu_kernels, monkeypatch):
    """A bfloat16 x's w8 GEMV rows (bf16_gemm): rows of the identity give back each weight dequantized as the layout
    defines it and rounded to bfloat16 once, bit for bit, through the bfloat16 products (gemv_int8_dot.h) as through
    the float32 GEMV; K = 200 ends in a partial chunk of 32 columns. Where the integer GEMV runs (AMX-INT8 CPUs: x
    rounded to integers on a step of its own), within its bound."""
    monkeypatch.setenv("OCTAVO_CPU_W8_GEMV", "")
    k = 200
    generator = torch.Generator().manual_seed(rows + group_size)
    x = torch.eye(k)[:rows].bfloat16()
    qweight, scales = w8_weight(45, k, group_size, torch.float16, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, group_size, True)
    weight = dequantize_w8(qweight, scales, group_size)
    if integer_w8_gemv_runs(cpu_kernels, rows) and group_size >= k:
        assert_within_int8_rounding(output, x, qweight, scales, None)
    elif integer_w8_gemv_runs(cpu_kernels, rows):
        assert_within_grouped_integer_rounding(output, x, weight, weight.abs(), 1, None)
    else:
        assert torch.equal(output, weight.bfloat16().T[:rows])


def decode_rows(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Decode rows of a reduced-precision model, each of its own scale, the first with an outlier."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 4).to(dtype)
    x[0, 3] = 40.0  # an outlier: its row's step is coarse
    return x


def assert_within_grouped_integer_rounding(output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                           terms: torch.Tensor, weight_roundings: int,
                                           bias: torch.Tensor | None) -> None:
    """A grouped integer GEMV's result against the definition (`weight`, the layout's float32 dequantization).

    Up to float32 roundings the GEMV computes sum_k w~_k x~_k + bias, where x~_k = xi_k * s (s = max |x_row| / 32767,
    which moves x_k by at most (0.5 + 2^-9) s + 2^-22 |x_k|) and w~_k is the weight in exact arithmetic from its
    stored parts, whose terms' magnitudes `terms` [N, K] holds (|q scale| for w8, |q scale| + |offset| for w4);
    the definition's weight is w~_k after `weight_roundings` float32 roundings, within gamma_r of `terms`. Fewer
    than K additions and 8 other operations stand on any term's way. So the bound is
      sum_k |w_k| ((0.5 + 2^-9) s + 2^-22 |x_k|) + (gamma_r + gamma_{K+8}) sum_k terms_k (|x_k| + s)
      + gamma_{K+8} |bias|,
    plus the output's rounding to x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).double()
    k = flat.shape[1]
    weight = weight.double()
    exact = flat @ weight.T + (0 if bias is None else bias.double())
    step = flat.abs().amax(dim=1, keepdim=True) / 32767
    unit = 2.0 ** -24

    def gamma(n: int) -> float:
        return n * unit / (1 - n * unit)

    integer_rounding = (0.5 + 2.0 ** -9) * step * weight.abs().sum(dim=1) + 2.0 ** -22 * (flat.abs() @ weight.abs().T)
    bias_part = 0 if bias is None else gamma(k + 8) * bias.double().abs()
    bound = integer_rounding + (gamma(weight_roundings) + gamma(k + 8)) * ((flat.abs() + step) @ terms.double().T)
    bound = bound + bias_part
    bound = bound + OUTPUT_UNIT[x.dtype] * (exact.abs() + bound) + 1e-30
    error = (output.reshape(exact.shape).double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst excess {(error - bound).max():.3g}"


# (rows, N, K): a partial tile of 16 rows; N no multiple of a block of 32; K no multiple of a tile's 64, K split into
# parts (1536); SmolLM2's shapes.
INT8_SHAPES = [(9, 37, 100), (33, 300, 200), (64, 96, 1536), (70, 960, 576), (512, 64, 576)]


@pytest.mark.parametrize(("rows", "n", "k"), INT8_SHAPES, ids=lambda value: str(value))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_per_row_int8_gemm(rows, n, k, dtype, cpu_kernels, monkeypatch):
    """Weights with one scale per row above 8 rows: on AMX-INT8 CPUs x's rows rounded to 16-bit integers and the
    int8 weights multiplied as they are (a tighter bound than bfloat16's), elsewhere the bfloat16 GEMM's bound;
    OCTAVO_CPU_QUANTIZED_GEMM=amx_bf16 asks for the dequantizing AMX GEMM instead (vdpbf16ps without AMX)."""
    monkeypatch.setenv("OCTAVO_CPU_QUANTIZED_GEMM", "")
    generator = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 4).to(dtype)
    x[0, 3] = 40.0  # an outlier: its row's step is coarse
    bias = torch.randn(n, generator=generator)
    qweight, scales = w8_weight(n, k, k, torch.float16, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, k, True)
    if int8_gemm_runs(cpu_kernels):
        assert_within_int8_rounding(output, x, qweight, scales, bias)
    else:
        assert_within_rounding(output, x, dequantize_w8(qweight, scales, k), bias, bf16_gemm=True)
    monkeypatch.setenv("OCTAVO_CPU_QUANTIZED_GEMM", "amx_bf16")
    dequantizing = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, k, True)
    assert_within_rounding(dequantizing, x, dequantize_w8(qweight, scales, k), bias, bf16_gemm=True)
    if int8_gemm_runs(cpu_kernels) and dtype == torch.float32:
        assert not torch.equal(output, dequantizing)


def test_per_row_int8_gemm_rows_of_zeros_and_non_finite_values(cpu_kernels):
    """A row of zeros gives the bias exactly; a NaN or an infinity in a row makes that row's outputs NaN or infinite
    (as a float GEMM's), never finite numbers from saturated integers; the other rows are unaffected."""
    generator = torch.Generator().manual_seed(21)
    x = torch.randn(12, 128, generator=generator)
    x[1] = 0.0
    x[4, 7] = float("nan")
    x[6, 100] = float("inf")
    bias = torch.randn(40, generator=generator)
    qweight, scales = w8_weight(40, 128, 128, torch.float32, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, 128, True)
    assert torch.equal(output[1], bias)
    assert not output[4].isfinite().any() and not output[6].isfinite().any()
    finite = [r for r in range(12) if r not in (4, 6)]
    assert output[finite].isfinite().all()


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 9])
def test_scale_dtypes(scale_dtype, rows, cpu_kernels):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 96, generator=generator)
    qweight, scales = w8_weight(19, 96, 32, scale_dtype, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 32)
    assert_within_rounding(output, x, dequantize_w8(qweight, scales, 32), None, w8=True)
    packed, scales, offsets = w4_weight(19, 96, 32, scale_dtype, generator)
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, None, 32)
    assert_within_rounding(output, x, dequantize_w4(packed, scales, offsets, 32), None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 9])
def test_reduced_precision_activations(dtype, rows, cpu_kernels):
    """x in bfloat16 / float16: computed in float32, rounded to x's dtype once (bias of x's dtype too)."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    bias = torch.randn(45, generator=generator).to(dtype)
    qweight, scales = w8_weight(45, 64, 64, torch.bfloat16, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, bias, 64)
    assert_within_rounding(output, x, dequantize_w8(qweight, scales, 64), bias.float(), w8=True)
    packed, scales, offsets = w4_weight(45, 64, 32, torch.bfloat16, generator)
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, bias, 32)
    assert_within_rounding(output, x, dequantize_w4(packed, scales, offsets, 32), bias.float())


@pytest.mark.parametrize("shape", [(1, 46), (2, 3, 46), (70, 46)], ids=["row", "batched", "gemm"])
def test_odd_group_sizes_and_leading_dims(shape, cpu_kernels):
    """Groups of 7 and 9 columns: w8 vectors never fill a group, w4 groups start on odd columns."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=generator)
    qweight, scales = w8_weight(21, 46, 7, torch.float32, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 7)
    assert_within_rounding(output, x, dequantize_w8(qweight, scales, 7), None, w8=True)
    packed, scales, offsets = w4_weight(21, 46, 9, torch.float32, generator)
    output = torch.ops.octavo_cpu.linear_w4(x, packed, scales, offsets, None, 9)
    assert_within_rounding(output, x, dequantize_w4(packed, scales, offsets, 9), None)


def test_large_layer_spans_threads(cpu_kernels):
    """A layer of several GEMV tasks (1.5 MB of int8), wider than any group or tile: every row is computed."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1536, generator=generator)
    qweight, scales = w8_weight(1000, 1536, 32, torch.float16, generator)
    output = torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 32)
    assert_within_rounding(output, x, dequantize_w8(qweight, scales, 32), None, w8=True)


def test_bad_arguments_name_what_is_wrong(cpu_kernels):
    x = torch.randn(2, 8)
    qweight, scales = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1)
    with pytest.raises(RuntimeError, match="qweight must be a 2-d int8"):
        torch.ops.octavo_cpu.linear_w8(x, qweight.to(torch.uint8), scales, None, 8)
    with pytest.raises(RuntimeError, match=r"scales must be a float16, bfloat16 or float32 tensor \[4, 2\]"):
        torch.ops.octavo_cpu.linear_w8(x, qweight, scales, None, 4)
    with pytest.raises(RuntimeError, match="does not end in 8"):
        torch.ops.octavo_cpu.linear_w8(torch.randn(2, 6), qweight, scales, None, 8)
    with pytest.raises(RuntimeError, match="bias must be a float tensor"):
        torch.ops.octavo_cpu.linear_w8(x, qweight, scales, torch.ones(5), 8)
    with pytest.raises(RuntimeError, match="group_size must be positive"):
        torch.ops.octavo_cpu.linear_w4(x, torch.zeros(4, 4, dtype=torch.uint8), scales, scales, None, 0)
    with pytest.raises(RuntimeError, match="offsets must be"):
        torch.ops.octavo_cpu.linear_w4(x, torch.zeros(4, 4, dtype=torch.uint8), scales, torch.ones(4, 2), None, 8)


def test_fake_kernels_describe_the_outputs(cpu_kernels):
    """opcheck: the schemas and the fake (meta) kernels agree with what the C++ ops do."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 40, generator=generator)
    qweight, scales = w8_weight(24, 40, 32, torch.float16, generator)
    torch.library.opcheck(torch.ops.octavo_cpu.linear_w8.default, (x, qweight, scales, None, 32),
                          test_utils=("test_schema", "test_faketensor"))
    packed, scales, offsets = w4_weight(24, 40, 32, torch.float16, generator)
    torch.library.opcheck(torch.ops.octavo_cpu.linear_w4.default, (x, packed, scales, offsets, None, 32),
                          test_utils=("test_schema", "test_faketensor"))
    qweight, scales = fp8_weight(24, 40, generator)
    # (opcheck's test_schema compares its inputs with an arithmetic torch lacks for float8 tensors.)
    torch.library.opcheck(torch.ops.octavo_cpu.linear_fp8.default, (x, qweight, scales, None),
                          test_utils=("test_faketensor",))


def test_cpu_backend_lowers_w8_w4_and_fp8_to_the_native_kernels(cpu_kernels):
    """On the cpu backend w8, w4 and fp8 linears (the last one too) run the C++ kernels, on float32 scales, their
    weights as stored (no dequantized copy). Their GEMMs run in bfloat16 exactly where the CPU has native bfloat16,
    except the last linear's (fp8 here), which produces the logits in float32.
    """
    from octavo.codegen.lowering import lower_graph
    from octavo.codegen.torch_backend.weight_packing import CpuFeatures
    from tests.codegen.test_torch_quantized_linear import _quantized_graph

    generator = torch.Generator().manual_seed(9)
    x = torch.randn(3, 96, generator=generator)
    graph_module, dense, _ = _quantized_graph(0.1 * torch.randn(40, 96, generator=generator))
    lower_graph(graph_module, "cpu", torch.float32)
    calls = [node for node in graph_module.graph.nodes if node.op == "call_function"]
    native = torch.ops.octavo_cpu
    assert [node.target for node in calls] == [native.linear_w8.default, native.linear_w8.default,
                                               native.linear_w4.default, native.linear_w4.default,
                                               native.linear_fp8.default]
    for node in calls:
        assert node.args[-1] is (CpuFeatures.detect().native_bf16 and node is not calls[-1])
        parameters = node.args[2:4] if node.target == native.linear_w4.default else node.args[2:3]
        assert all(getattr(graph_module, arg.target).dtype == torch.float32 for arg in parameters)
    assert getattr(graph_module, calls[-1].args[1].target).dtype == torch.float8_e4m3fn
    for output, (name, weight) in zip(graph_module(x), dense.items(), strict=True):
        assert_within_rounding(output, x, weight, None, w8=name.startswith("w8"))
