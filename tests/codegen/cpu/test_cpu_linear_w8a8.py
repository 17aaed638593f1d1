"""octavo_cpu::pack_w8a8 / linear_w8a8: int8 weights (one scale per output row) times x rounded to int8 in groups
of 64 columns, against the definition written out here.

The definition (gemm_w8a8.h): per row of x and group of 64 columns, step = max|x| / 127 and xq = nearest-even(x *
(127 / max|x|)), each rounded to float32 once; the group's sum of xq * q exact; the groups' step * sum added in
float32 (fma) in K's order; then fma(acc, scale, bias) and one rounding to x's dtype. The reference below forms xq
and step with the same float32 operations (so they are the same bits) and every sum exactly in float64, so the
kernel may differ only by its float32 additions of the groups and its final fma: with u = 2^-24 and G groups,
|out - exact| <= (G + 1) * u * (|scale| * sum_g |step_g * dot_g| + |bias|) before the result's own rounding to x's
dtype (its unit roundoff 2^-p: 2^-8 relative for bfloat16, 2^-11 for float16). Every path of the kernel computes
the same bits and is held to that bound: this CPU's (vpdpbusd on AVX512_VNNI; the AVX2 build's vpmaddubsw, which
test_cpu_lower_isa_levels reruns this file under) and the plain loops (OCTAVO_CPU_W8A8_KERNEL=portable), which must
also give the same bits as this CPU's path.
"""

from __future__ import annotations

import pytest
import torch

GROUP = 64
UNIT = 2.0**-24
ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff 2^-p


def reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact result in float64, the bound's magnitude sum_g |step_g * dot_g| * |scale| + |bias|) by the definition."""
    xf = x.float()
    exact = torch.zeros(x.shape[0], qweight.shape[0], dtype=torch.float64)
    magnitude = torch.zeros_like(exact)
    for first in range(0, x.shape[1], GROUP):
        part = xf[:, first:first + GROUP]
        amax = part.abs().amax(-1, keepdim=True)
        factor = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
        xq = torch.round(part * factor).clamp(-127, 127)
        step = (amax / 127.0).double()
        terms = (xq.double() @ qweight[:, first:first + GROUP].double().t()) * step
        exact += terms
        magnitude += terms.abs()
    scale = scales.double()[None]
    exact = exact * scale + (bias.double() if bias is not None else 0.0)
    magnitude = magnitude * scale.abs() + (bias.double().abs() if bias is not None else 0.0)
    return exact, magnitude


def assert_within_bound(output: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None) -> None:
    exact, magnitude = reference(x, qweight, scales, bias)
    groups = -(-x.shape[1] // GROUP)
    bound = (groups + 1) * UNIT * magnitude * (1 + ROUNDOFF[x.dtype]) + ROUNDOFF[x.dtype] * exact.abs() * 1.0001
    error = (output.double() - exact).abs()
    assert output.dtype == x.dtype and output.shape == exact.shape
    assert bool((error <= bound + 1e-30).all()), f"largest excess {(error - bound).max().item()}"


def weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    return qweight, torch.rand(n, generator=generator) * 0.02 + 1e-4


# (rows, N, K): rows across the GEMV's and the tiles' (4 rows) edges, N no multiple of 16 or 64, K no multiple of 4
# or of the 64-column group (33, 101, 1538), SmolLM2's shapes (960 x 576, 576 x 1536).
SHAPES = [(1, 37, 100), (3, 13, 216), (5, 960, 576), (8, 96, 1538), (13, 50, 33), (70, 576, 1536), (2, 5, 3)]


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES, ids=lambda value: str(value))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_linear_w8a8_within_its_rounding(rows, n, k, dtype, cpu_kernels, monkeypatch):
    qweight, scales = weight(n, k, rows * n + k)
    generator = torch.Generator().manual_seed(k)
    # Columns of very different sizes: each group's step must follow its own largest value.
    x = (torch.randn(rows, k, generator=generator) * torch.logspace(-2, 1, k)).to(dtype)
    bias = torch.randn(n, generator=generator) if rows % 2 else None
    packed = torch.ops.octavo_cpu.pack_w8a8(qweight)
    monkeypatch.delenv("OCTAVO_CPU_W8A8_KERNEL", raising=False)
    output = torch.ops.octavo_cpu.linear_w8a8(x, packed, scales, bias, n, k)
    assert_within_bound(output, x, qweight, scales, bias)
    monkeypatch.setenv("OCTAVO_CPU_W8A8_KERNEL", "portable")
    assert torch.equal(torch.ops.octavo_cpu.linear_w8a8(x, packed, scales, bias, n, k), output)


def test_leading_dimensions_and_zero_rows(cpu_kernels):
    """x [2, 3, K] keeps its leading dimensions; an all-zero row (and an all-zero group) gives exactly the bias."""
    n, k = 40, 130
    qweight, scales = weight(n, k, 7)
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(3))
    x[0, 1] = 0.0
    x[1, 2, :64] = 0.0
    bias = torch.randn(n)
    output = torch.ops.octavo_cpu.linear_w8a8(x, torch.ops.octavo_cpu.pack_w8a8(qweight), scales, bias, n, k)
    assert output.shape == (2, 3, n)
    assert torch.equal(output[0, 1], bias)
    assert_within_bound(output.reshape(6, n), x.reshape(6, k), qweight, scales, bias)


def test_results_do_not_depend_on_earlier_calls_or_the_layout_of_x(cpu_kernels):
    """The calling thread reuses its quantized rows' buffers (and frees them past 1 MiB): a one-row call gives the
    same bits before and after calls of other shapes, one of more than 1 MiB of int8 rows among them; and x read
    through a strided view gives the bits of its contiguous copy."""
    ops = torch.ops.octavo_cpu
    generator = torch.Generator().manual_seed(17)
    small_q, small_scales = weight(24, 100, 1)
    small_packed = ops.pack_w8a8(small_q)
    row = torch.randn(1, 100, generator=generator).to(torch.bfloat16)
    first = ops.linear_w8a8(row, small_packed, small_scales, None, 24, 100)
    large_q, large_scales = weight(16, 1000, 2)
    large_x = torch.randn(1100, 1000, generator=generator)  # 1100 rows x 1024 padded columns of int8 > 1 MiB
    large = ops.linear_w8a8(large_x, ops.pack_w8a8(large_q), large_scales, None, 16, 1000)
    assert_within_bound(large, large_x, large_q, large_scales, None)
    wide_q, wide_scales = weight(8, 300, 3)
    ops.linear_w8a8(torch.randn(3, 300, generator=generator), ops.pack_w8a8(wide_q), wide_scales, None, 8, 300)
    assert torch.equal(ops.linear_w8a8(row, small_packed, small_scales, None, 24, 100), first)
    strided = torch.randn(100, 5, generator=generator).to(torch.bfloat16).t()
    assert not strided.is_contiguous()
    assert torch.equal(ops.linear_w8a8(strided, small_packed, small_scales, None, 24, 100),
                       ops.linear_w8a8(strided.contiguous(), small_packed, small_scales, None, 24, 100))


def test_close_to_the_float_linear_within_the_activation_rounding(cpu_kernels):
    """Against x @ (q * scale).T in float64: each x moves by at most step / 2 = max|x in its group| / 254."""
    n, k = 64, 576
    qweight, scales = weight(n, k, 11)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(5))
    output = torch.ops.octavo_cpu.linear_w8a8(x, torch.ops.octavo_cpu.pack_w8a8(qweight), scales, None, n, k)
    full = x.double() @ (qweight.double() * scales.double()[:, None]).t()
    half_steps = x.abs().reshape(6, -1, GROUP).amax(-1, keepdim=True).expand(-1, -1, GROUP).reshape(6, k) / 254
    bound = half_steps.double() @ (qweight.double().abs() * scales.double()[:, None]).t()
    assert bool(((output.double() - full).abs() <= bound * 1.0001 + 1e-5).all())
    assert not torch.equal(output.double(), full), "x was not rounded"


def test_packed_layout_is_the_documented_one(cpu_kernels):
    """packed[b][k4][i][j] = q[16 b + i][4 k4 + j] + 128, rows and columns past the weight (to whole groups) 128."""
    qweight, _ = weight(21, 70, 2)
    packed = torch.ops.octavo_cpu.pack_w8a8(qweight)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 32, 16, 4)
    expected = torch.full((32, 128), 128, dtype=torch.int32)
    expected[:21, :70] = qweight.int() + 128
    assert torch.equal(packed.int().permute(0, 2, 1, 3).reshape(32, 128), expected)


def test_bad_arguments_are_refused_by_name(cpu_kernels, monkeypatch):
    qweight, scales = weight(16, 64, 1)
    packed = torch.ops.octavo_cpu.pack_w8a8(qweight)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="packed must be pack_w8a8's"):
        torch.ops.octavo_cpu.linear_w8a8(x, packed, scales, None, 17, 64)
    with pytest.raises(RuntimeError, match="does not end in 64"):
        torch.ops.octavo_cpu.linear_w8a8(torch.randn(2, 63), packed, scales, None, 16, 64)
    with pytest.raises(RuntimeError, match="scales must be a float32 tensor of 16"):
        torch.ops.octavo_cpu.linear_w8a8(x, packed, scales[:8], None, 16, 64)
    with pytest.raises(RuntimeError, match="2-d int8"):
        torch.ops.octavo_cpu.pack_w8a8(qweight.float())
    monkeypatch.setenv("OCTAVO_CPU_W8A8_KERNEL", "fast")
    with pytest.raises(RuntimeError, match="OCTAVO_CPU_W8A8_KERNEL must be portable"):
        torch.ops.octavo_cpu.linear_w8a8(x, packed, scales, None, 16, 64)
