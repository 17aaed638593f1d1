"""Triton linear_w8 / linear_w4 / linear_fp8 / linear_w16 against dequantize-then-matmul in float32 (the ops'
definitions)."""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import assert_close_for_dtype

from octavo.codegen.triton_backend.quantized_linear import embedding_w4, linear_fp8, linear_w4, linear_w8, linear_w16
from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.ir.ops.quantized_linear import linear_reference
from octavo.passes.quantize_rtn import quantize_fp8, quantize_w4, quantize_w8
from octavo.runtime.engine import LLMEngine

# (leading dims, K, N, group): N not a multiple of the 64-column tile; K not a multiple of the group (96 / 64,
# 48 / 32) nor of the 32-wide K slice (48); more rows than one 16-row tile.
SHAPES = [((1, 1), 64, 24, 32), ((1, 5), 96, 40, 64), ((3,), 48, 17, 32), ((1, 20), 64, 72, 64)]


def _inputs(leading, columns, out, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, columns, generator=generator).to(dtype)
    weight = 0.1 * torch.randn(out, columns, generator=generator)
    bias = torch.randn(out, generator=generator).to(dtype)
    return x, weight, bias


def _run(layout, quantized, x, bias, device):
    tensors = [t.to(device) for t in quantized.tensors().values()]
    bias = None if bias is None else bias.to(device)
    if layout == "w8":
        return linear_w8(x.to(device), *tensors, bias, quantized.group_size)
    if layout == "w4":
        return linear_w4(x.to(device), *tensors, bias, quantized.group_size)
    return linear_fp8(x.to(device), *tensors, bias)


@pytest.mark.parametrize("layout", ["w8", "w8-groups", "w4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("leading", "columns", "out", "group"), SHAPES)
def test_quantized_linear(leading, columns, out, group, layout, dtype, device):
    x, weight, bias = _inputs(leading, columns, out, dtype, device)
    quantized = {"w8": lambda: quantize_w8(weight), "w8-groups": lambda: quantize_w8(weight, group),
                 "w4": lambda: quantize_w4(weight, group), "fp8": lambda: quantize_fp8(weight)}[layout]()
    actual = _run(layout.split("-")[0], quantized, x, bias, device)
    expected = linear_reference(x, quantized.dequantize(), bias)
    assert actual.shape == expected.shape and actual.dtype == dtype
    # bf16: the weight meets the bf16 activations rounded to bf16 (tensor-core inputs): a bf16 ulp per product.
    assert_close_for_dtype(actual, expected, dtype)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("leading", "columns", "out", "group"), SHAPES)
def test_linear_w16_widens_tiles_in_the_kernel(leading, columns, out, group, weight_dtype, device):
    """octavo.linear_w16: float32 x, a 16-bit weight widened (exactly) slice by slice, IEEE float32 products."""
    x, weight, bias = _inputs(leading, columns, out, torch.float32, device)
    narrow = weight.to(weight_dtype)
    actual = linear_w16(x.to(device), narrow.to(device), bias.to(device))
    expected = torch.ops.octavo.linear_w16(x, narrow, bias)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert_close_for_dtype(actual, expected, torch.float32)


def test_without_bias(device):
    x, weight, _ = _inputs((2,), 64, 24, torch.float32, device)
    quantized = quantize_w4(weight, 32)
    assert_close_for_dtype(_run("w4", quantized, x, None, device), linear_reference(x, quantized.dequantize(), None),
                           torch.float32)


def test_embedding_runs_the_reference_on_the_device(device):
    table = quantize_w4(torch.randn(30, 64), 32)
    indices = torch.tensor([[4, 29, 4]])
    result = embedding_w4(*(t.to(device) for t in table.tensors().values()), indices.to(device), 32, torch.float32)
    assert torch.equal(result.cpu(), torch.nn.functional.embedding(indices, table.dequantize()))


def test_quantized_kv_cache_is_refused_at_load(tiny_quantized_artifact, device):
    artifact = tiny_quantized_artifact("llama", quant="w4", kv_cache_dtype="int8")  # shared with other tests
    with pytest.raises(OctavoError, match="no int8/fp8 KV cache kernels"):
        LLMEngine(artifact, EngineConfig(backend="triton", device=device.type, num_kv_blocks=16))
