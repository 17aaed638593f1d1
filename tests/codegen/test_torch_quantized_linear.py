"""torch backend quantized linears: each CPU kernel against dequantize-then-matmul in float32, and the choice.

Tolerances follow from the arithmetic of each kernel, as multiples of S = sum_k |x_k| |w_k|
(with the weight's magnitude taken as what the kernel multiplies: for int4pack |q_k - 8| * scale
+ |zero|, for int8pack |w_k| + scale):

- float32 (the dequantized kernel in float32): two float32 sums of K products in different orders
  (the kernel's and the reference's) each lie within gamma_K S, gamma_K = K u / (1 - K u) with
  u = 2^-24, of the exact sum; for fp8 the scales multiply the result (one more rounding of the
  output) where the reference rounds each dequantized weight (one more of each term): 2 u S more.
- bfloat16 (the packed kernels, and dequantized weights in bfloat16): the activation, the scale
  and the zero point (or the dequantized weight) are each rounded once to bfloat16 (relative
  error <= 2^-8 each: 8 significant bits), and so is the result (and a bfloat16 reference's own result): at
  most four such roundings, 4 * 2^-8 = 2^-6 of S, plus the float32 accumulation's 2 gamma_K S.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from octavo.codegen.torch_backend.quantized_linear import (
    linear_dequantized,
    linear_int4pack,
    linear_int8pack,
    pack_int4,
    pack_int8,
)
from octavo.codegen.torch_backend.weight_packing import FORCE_KERNEL_ENV, CpuFeatures, pack_quantized_linears
from octavo.ir.ops.quantized_linear import linear_reference
from octavo.passes.quantize_rtn import quantize_fp8, quantize_w4, quantize_w8

octavo = torch.ops.octavo
# (M rows, K, N, group): N not a multiple of 16 (int4pack pads rows), K not a multiple of the group (short last group).
SHAPES = [(1, 64, 32, 32), (5, 96, 24, 64), (3, 576, 40, 128), (7, 128, 48, 32)]


def _data(rows: int, columns: int, out: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, rows, columns, generator=generator), 0.1 * torch.randn(out, columns, generator=generator),
            torch.randn(out, generator=generator))


def _gamma(columns: int) -> float:
    """The relative error bound of a float32 sum of `columns` products (gamma_K)."""
    return columns * 2**-24 / (1 - columns * 2**-24)


def _bf16_bound(x: torch.Tensor, weight_magnitude: torch.Tensor) -> torch.Tensor:
    return (2**-6 + 2 * _gamma(x.shape[-1])) * (x.abs().float() @ weight_magnitude.float().T)


def _f32_bound(x: torch.Tensor, weight_magnitude: torch.Tensor, extra_roundings: int = 0) -> torch.Tensor:
    return (2 * _gamma(x.shape[-1]) + extra_roundings * 2**-24) * (x.abs().float() @ weight_magnitude.float().T)


def _check(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    excess = (actual.float() - expected.float()).abs() - bound
    assert excess.max() <= 0, f"exceeds the bound by {excess.max():.3g}"


@pytest.mark.parametrize(("rows", "columns", "out", "group"), SHAPES)
def test_int8pack_kernel(rows, columns, out, group):
    x, weight, bias = _data(rows, columns, out)
    quantized = quantize_w8(weight)
    packed = pack_int8(quantized.qweight, quantized.scales, torch.bfloat16)
    actual = linear_int8pack(x, packed["qweight"], packed["scales"], bias)
    dense = quantized.dequantize()
    # A bias add in float32 after the bf16 result adds nothing to the bound.
    _check(actual, linear_reference(x, dense, bias), _bf16_bound(x, dense.abs() + quantized.scales))


@pytest.mark.parametrize(("rows", "columns", "out", "group"), SHAPES)
def test_int4pack_kernel(rows, columns, out, group):
    x, weight, bias = _data(rows, columns, out, seed=1)
    quantized = quantize_w4(weight, group)
    packed = pack_int4(quantized.qweight, quantized.scales, quantized.offsets, group, torch.bfloat16)
    actual = linear_int4pack(x, packed["packed"], packed["scales_and_zeros"], bias, group, out)
    dense = quantized.dequantize()
    _check(actual, linear_reference(x, dense, bias), _bf16_bound(x, _int4pack_magnitude(quantized, group, columns)))


def _scale_per_weight(quantized, columns: int) -> torch.Tensor:
    """The scale each weight is multiplied by: [N, K] from per-channel ([N] or [N, 1]) or group-wise scales."""
    scales = quantized.scales.float().reshape(quantized.scales.shape[0], -1)
    return scales.repeat_interleave(-(-columns // scales.shape[1]), 1)[:, :columns]


def _int4pack_magnitude(quantized, group: int, columns: int) -> torch.Tensor:
    """|w| + 8 scale + |zero| per weight: what int4pack's terms (q - 8) * scale + zero can round (see the docstring)."""
    scale = quantized.scales.float().repeat_interleave(group, 1)[:, :columns]
    zero = (quantized.offsets.float() + 8 * quantized.scales.float()).repeat_interleave(group, 1)[:, :columns]
    return quantized.dequantize().abs() + 8 * scale + zero.abs()


@pytest.mark.parametrize(("rows", "columns", "out", "group"), SHAPES)
@pytest.mark.parametrize("layout", ["w8", "w4", "fp8"])
def test_dequantized_kernel_in_float32(rows, columns, out, group, layout):
    x, weight, bias = _data(rows, columns, out, seed=2)
    quantized = {"w8": lambda: quantize_w8(weight, group), "w4": lambda: quantize_w4(weight, group),
                 "fp8": lambda: quantize_fp8(weight)}[layout]()
    dense = quantized.dequantize()
    if layout == "fp8":  # the exact fp8 values, scaled per output channel after the matmul
        actual = linear_dequantized(x, quantized.qweight.float(), quantized.scales, bias)
    else:
        actual = linear_dequantized(x, dense, None, bias)
    # float32 sums in another order; fp8: one more rounding of the output and of each dequantized weight.
    bound = _f32_bound(x, dense.abs(), extra_roundings=2 if layout == "fp8" else 0)
    # The bias is added to both in float32: one more rounding of the output, 2^-24 |y| <= 2^-24 (S + |bias|).
    bound = bound + 2**-24 * (x.abs() @ dense.abs().T + bias.abs())
    _check(actual, linear_reference(x, dense, bias), bound)


def test_bfloat16_activations_stay_bfloat16():
    x, weight, _ = _data(4, 64, 32, seed=3)
    x = x.bfloat16()
    quantized = quantize_w4(weight, 32)
    packed = pack_int4(quantized.qweight, quantized.scales, quantized.offsets, 32, torch.bfloat16)
    actual = linear_int4pack(x, packed["packed"], packed["scales_and_zeros"], None, 32, 32)
    expected = linear_reference(x, quantized.dequantize(), None)
    assert actual.dtype == torch.bfloat16
    _check(actual, expected, _bf16_bound(x, _int4pack_magnitude(quantized, 32, 64)))


# ---------------------------------------------------------------- choice and packing at load

FAST = CpuFeatures(avx512=True, native_bf16=True)
AVX2 = CpuFeatures(avx512=False, native_bf16=False)


def _quantized_graph(weight: torch.Tensor) -> tuple[torch.fx.GraphModule, dict[str, torch.Tensor], dict]:
    """x -> five quantized linears of `weight` (w8 per channel, w8 groups of 32, w4 groups 32 and 48, fp8); their
    dequantized weights and the bfloat16 bound's weight magnitude of each."""
    variants = {"w8": quantize_w8(weight), "w8g": quantize_w8(weight, 32), "w4": quantize_w4(weight, 32),
                "w4g48": quantize_w4(weight, 48), "fp8": quantize_fp8(weight)}
    module, graph = torch.nn.Module(), torch.fx.Graph()
    x = graph.placeholder("x")
    results, dense, magnitude = [], {}, {}
    for name, quantized in variants.items():
        nodes = []
        for role, tensor in quantized.tensors().items():
            module.register_buffer(f"{name}_{role}", tensor)
            nodes.append(graph.get_attr(f"{name}_{role}"))
        op = {"w8": octavo.linear_w8, "w4": octavo.linear_w4, "fp8": octavo.linear_fp8}[quantized.layout].default
        extra = () if quantized.layout == "fp8" else (quantized.group_size,)
        results.append(graph.call_function(op, (x, *nodes, None, *extra)))
        dense[name] = quantized.dequantize()
        magnitude[name] = _int4pack_magnitude(quantized, quantized.group_size, weight.shape[1]) \
            if quantized.layout == "w4" else dense[name].abs() + _scale_per_weight(quantized, weight.shape[1])
    graph.output(tuple(results))
    return torch.fx.GraphModule(module, graph), dense, magnitude


# The last linear (here fp8) produces the logits: in float32 whenever the activations are float32.
@pytest.mark.parametrize(("features", "dtype", "expected", "compute"), [
    (FAST, torch.float32, ["int8pack", "dequantized", "int4pack", "dequantized", "dequantized"],
     ["bfloat16"] * 4 + ["float32"]),
    (AVX2, torch.float32, ["dequantized"] * 5, ["float32"] * 5),
    (AVX2, torch.bfloat16, ["int8pack", "dequantized", "dequantized", "dequantized", "dequantized"],
     ["bfloat16"] * 5),
])
def test_kernel_choice_by_machine_and_packed_graph_computes_the_reference(features, dtype, expected, compute):
    x, weight, _ = _data(3, 96, 32, seed=4)
    x = x.to(dtype)
    gm, dense, magnitude = _quantized_graph(weight)
    choices = pack_quantized_linears(gm, dtype, features)
    kernels = [node.target._opname.removeprefix("linear_") for node in gm.graph.nodes if node.op == "call_function"]
    assert kernels == expected
    assert sum(choices.values()) == 5
    assert Counter(f"{kernel} ({dtype})" for kernel, dtype in zip(expected, compute, strict=True)) == choices
    for actual, name, dtype in zip(gm(x), dense, compute, strict=True):
        bound = _bf16_bound(x, magnitude[name]) if dtype == "bfloat16" else \
            _f32_bound(x, dense[name].abs(), extra_roundings=2 if name == "fp8" else 0)
        _check(actual, linear_reference(x, dense[name], None), bound)
    assert not any("_qweight" in name and "int8pack" not in name for name, _ in gm.named_buffers()), \
        "portable weights that no kernel reads any more are dropped"


def test_forcing_the_dequantized_kernel(monkeypatch):
    monkeypatch.setenv(FORCE_KERNEL_ENV, "dequantized")
    gm, _, _ = _quantized_graph(_data(1, 96, 32)[1])
    pack_quantized_linears(gm, torch.float32, FAST)
    assert {node.target for node in gm.graph.nodes if node.op == "call_function"} == {
        torch.ops.octavo_torch.linear_dequantized.default}


def test_int8pack_takes_a_misaligned_weight(one_thread):
    # A weights file aligns tensors to 8 bytes only; ATen's int8 kernel crashes on such a weight with M > 1.
    quantized = quantize_w8(0.1 * torch.randn(64, 64))
    storage = torch.zeros(64 * 64 + 8, dtype=torch.int8)
    misaligned = storage[8:].view(64, 64)
    misaligned.copy_(quantized.qweight)
    assert misaligned.data_ptr() % 64
    packed = pack_int8(misaligned, quantized.scales, torch.bfloat16)
    x = torch.randn(9, 64)
    actual = linear_int8pack(x, packed["qweight"], packed["scales"], None)
    dense = quantized.dequantize()
    _check(actual, linear_reference(x, dense, None), _bf16_bound(x, dense.abs() + quantized.scales))


@pytest.mark.parametrize(("rows", "columns", "out"), [(1, 3, 5), (4, 101, 37), (9, 576, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_w8a8_kernel_computes_its_definition(rows, columns, out, dtype):
    """octavo_torch::linear_w8a8 against the definition (tests/codegen/cpu/test_cpu_linear_w8a8.py's reference, exact
    in float64): it sums in float64 and rounds once to float32 (u = 2^-24 of the result), then to x's dtype."""
    from tests.codegen.cpu.test_cpu_linear_w8a8 import ROUNDOFF, reference

    generator = torch.Generator().manual_seed(rows * columns)
    x = (torch.randn(2, rows, columns, generator=generator) * torch.logspace(-1, 1, columns)).to(dtype)
    quantized = quantize_w8(0.1 * torch.randn(out, columns, generator=generator))
    bias = torch.randn(out, generator=generator)
    scales = quantized.scales.reshape(-1).float()
    actual = torch.ops.octavo_torch.linear_w8a8(x, quantized.qweight, scales, bias)
    exact, magnitude = reference(x.reshape(-1, columns), quantized.qweight, scales, bias)
    assert actual.shape == (2, rows, out) and actual.dtype == dtype
    # Both sums in float64 (relative 2^-53 per addition of the magnitudes), then the two roundings of the result.
    bound = (2**-24 + ROUNDOFF[dtype]) * exact.abs() * 1.0001 + 2**-40 * magnitude
    assert bool(((actual.reshape(-1, out).double() - exact).abs() <= bound).all())


def test_w8a8_choice_takes_per_channel_int8_linears_but_the_logits():
    """With int8 activations (a w8a8 artifact) the per-channel w8 linear takes linear_w8a8; grouped w8, w4, fp8 and
    the logits' linear (here the last, fp8) keep their choice."""
    gm, dense, _ = _quantized_graph(_data(1, 96, 32)[1])
    choices = pack_quantized_linears(gm, torch.float32, FAST, int8_activations=True)
    kernels = [node.target._opname.removeprefix("linear_") for node in gm.graph.nodes if node.op == "call_function"]
    assert kernels == ["w8a8", "dequantized", "int4pack", "dequantized", "dequantized"]
    assert choices["w8a8 (int8)"] == 1
    x = torch.randn(3, 96)
    exact = x.double() @ dense["w8"].double().t()
    # Against the float linear: each x moves by at most half its group's step, max|x in the group| / 254.
    largest = torch.nn.functional.pad(x.abs(), (0, 32)).reshape(3, 2, 64).amax(-1).repeat_interleave(64, 1)[:, :96]
    bound = (largest / 254 * 1.0001).double() @ dense["w8"].abs().double().t() + 1e-5
    assert bool(((gm(x)[0].double() - exact).abs() <= bound).all())


def test_w8a8_on_a_backend_without_an_int8_activation_kernel_is_refused():
    from octavo.codegen.lowering import lower_graph
    from octavo.errors import OctavoError

    gm, _, _ = _quantized_graph(_data(1, 96, 32)[1])
    with pytest.raises(OctavoError, match=r"w8a8 artifact .* triton has no int8-activation linear"):
        lower_graph(gm, "triton", torch.float32, int8_activations=True)
