"""torch backend quantized linears: each CPU kernel against dequantize-then-matmul in float32, and the choice.

Tolerances follow from the arithmetic of each kernel. The packed kernels compute in
bfloat16: the activation, the scale and the zero point are each rounded once to bfloat16
(relative error <= 2^-9 each) and so is the result, so every output element is within
4 * 2^-9 = 2^-7 of sum_k |x_k| (|w_k| + |q_k - 8| * scale + |zero|) of the float32 result
(the bound's weight term covers both the product and the rounded terms of the weight).
The dequantized kernel in float32 only reorders float32 sums.
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


def _bf16_bound(x: torch.Tensor, weight_magnitude: torch.Tensor) -> torch.Tensor:
    return 2**-7 * (x.abs() @ weight_magnitude.T)


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
    scale = quantized.scales.float().repeat_interleave(group, 1)[:, :columns]
    zero = (quantized.offsets.float() + 8 * quantized.scales.float()).repeat_interleave(group, 1)[:, :columns]
    _check(actual, linear_reference(x, dense, bias), _bf16_bound(x, dense.abs() + 8 * scale + zero.abs()))


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
    bound = 1e-6 * (x.abs() @ dense.abs().T) + 1e-6  # float32 sums in another order, one more rounding for fp8
    _check(actual, linear_reference(x, dense, bias), bound)


def test_bfloat16_activations_stay_bfloat16():
    x, weight, _ = _data(4, 64, 32, seed=3)
    x = x.bfloat16()
    quantized = quantize_w4(weight, 32)
    packed = pack_int4(quantized.qweight, quantized.scales, quantized.offsets, 32, torch.bfloat16)
    actual = linear_int4pack(x, packed["packed"], packed["scales_and_zeros"], None, 32, 32)
    expected = linear_reference(x, quantized.dequantize(), None)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), atol=0.05, rtol=2**-6)


# ---------------------------------------------------------------- choice and packing at load

FAST = CpuFeatures(avx512=True, native_bf16=True)
AVX2 = CpuFeatures(avx512=False, native_bf16=False)


def _quantized_graph(weight: torch.Tensor) -> tuple[torch.fx.GraphModule, dict[str, torch.Tensor]]:
    """x -> five quantized linears of `weight` (w8 per channel, w8 groups of 32, w4 groups 32 and 48, fp8), summed."""
    variants = {"w8": quantize_w8(weight), "w8g": quantize_w8(weight, 32), "w4": quantize_w4(weight, 32),
                "w4g48": quantize_w4(weight, 48), "fp8": quantize_fp8(weight)}
    module, graph = torch.nn.Module(), torch.fx.Graph()
    x = graph.placeholder("x")
    results, dense = [], {}
    for name, quantized in variants.items():
        nodes = []
        for role, tensor in quantized.tensors().items():
            module.register_buffer(f"{name}_{role}", tensor)
            nodes.append(graph.get_attr(f"{name}_{role}"))
        op = {"w8": octavo.linear_w8, "w4": octavo.linear_w4, "fp8": octavo.linear_fp8}[quantized.layout].default
        extra = () if quantized.layout == "fp8" else (quantized.group_size,)
        results.append(graph.call_function(op, (x, *nodes, None, *extra)))
        dense[name] = quantized.dequantize()
    graph.output(tuple(results))
    return torch.fx.GraphModule(module, graph), dense


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
    gm, dense = _quantized_graph(weight)
    choices = pack_quantized_linears(gm, dtype, features)
    kernels = [node.target._opname.removeprefix("linear_") for node in gm.graph.nodes if node.op == "call_function"]
    assert kernels == expected
    assert sum(choices.values()) == 5
    assert Counter(f"{kernel} ({dtype})" for kernel, dtype in zip(expected, compute, strict=True)) == choices
    for actual, reference in zip(gm(x), dense.values(), strict=True):
        expected_output = linear_reference(x, reference, None)
        torch.testing.assert_close(actual.float(), expected_output.float(), atol=0.05, rtol=2**-6)
    assert not any("_qweight" in name and "int8pack" not in name for name, _ in gm.named_buffers()), \
        "portable weights that no kernel reads any more are dropped"


def test_forcing_the_dequantized_kernel(monkeypatch):
    monkeypatch.setenv(FORCE_KERNEL_ENV, "dequantized")
    gm, _ = _quantized_graph(_data(1, 96, 32)[1])
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
    torch.testing.assert_close(actual, linear_reference(x, quantized.dequantize(), None), atol=0.05, rtol=2**-6)
