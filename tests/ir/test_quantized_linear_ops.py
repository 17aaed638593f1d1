"""octavo.linear_w8/w4/fp8 and embedding_w8/w4 against the float ops on the dequantized weight."""

from __future__ import annotations

import json

import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx_round_trip_helpers import assert_same_graph, round_trip
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from octavo.ir.quantized_layout import FP8, W4, W8, QuantizedWeight, pack_int4

octavo = torch.ops.octavo


def _weight(layout: str, rows: int, columns: int, group_size: int, seed: int = 0) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    groups = -(-columns // group_size)
    if layout == W8:
        q = torch.randint(-127, 128, (rows, columns), generator=generator, dtype=torch.int8)
        return QuantizedWeight(W8, q, 0.01 * torch.rand(rows, groups, generator=generator), None, group_size)
    if layout == W4:
        q = pack_int4(torch.randint(0, 16, (rows, columns), generator=generator, dtype=torch.uint8))
        scales = (0.02 * torch.rand(rows, groups, generator=generator)).half()
        return QuantizedWeight(W4, q, scales, (-8 * scales.float()).half(), group_size)
    q = torch.randn(rows, columns, generator=generator).to(torch.float8_e4m3fn)
    return QuantizedWeight(FP8, q, 0.01 * torch.rand(rows, generator=generator), None, columns)


def _call(weight: QuantizedWeight, x: torch.Tensor, bias):
    if weight.layout == W8:
        return octavo.linear_w8(x, weight.qweight, weight.scales, bias, weight.group_size)
    if weight.layout == W4:
        return octavo.linear_w4(x, weight.qweight, weight.scales, weight.offsets, bias, weight.group_size)
    return octavo.linear_fp8(x, weight.qweight, weight.scales, bias)


@pytest.mark.parametrize("layout", [W8, W4, FP8])
@pytest.mark.parametrize(("columns", "group_size"), [(64, 32), (96, 64), (576, 128)])  # 96, 576: short last group
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_is_the_float_linear_of_the_dequantized_weight(layout, columns, group_size, dtype):
    weight = _weight(layout, 24, columns, group_size)
    x = torch.randn(1, 5, columns).to(dtype)
    bias = torch.randn(24).to(dtype)
    result = _call(weight, x, bias)
    # Float64 of the same inputs: the op's float32 matmul differs by float32 accumulation only.
    expected = F.linear(x.double(), weight.dequantize().double(), bias.double())
    assert result.dtype == dtype and result.shape == (1, 5, 24)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # float32 sums of 576 terms; bf16: one final rounding
    torch.testing.assert_close(result.double(), expected.to(dtype).double(), atol=tolerance, rtol=tolerance)
    assert torch.equal(_call(weight, x, None), F.linear(x.float(), weight.dequantize()).to(dtype))


@pytest.mark.parametrize("layout", [W8, W4])
def test_embedding_gathers_dequantized_rows(layout):
    table = _weight(layout, 50, 64, 32, seed=3)
    indices = torch.tensor([[3, 0, 49, 3]])
    if layout == W8:
        result = octavo.embedding_w8(table.qweight, table.scales, indices, 32, torch.bfloat16)
    else:
        result = octavo.embedding_w4(table.qweight, table.scales, table.offsets, indices, 32, torch.bfloat16)
    assert torch.equal(result, F.embedding(indices, table.dequantize()).to(torch.bfloat16))


def _fake(weight: QuantizedWeight, mode: FakeTensorMode) -> QuantizedWeight:
    offsets = None if weight.offsets is None else mode.from_tensor(weight.offsets)
    return QuantizedWeight(weight.layout, mode.from_tensor(weight.qweight), mode.from_tensor(weight.scales), offsets,
                           weight.group_size)


def test_fake_impls_give_the_real_shapes_and_dtypes():
    x = torch.randn(2, 3, 64).bfloat16()
    weights = [_weight(layout, 24, 64, 32) for layout in (W8, W4, FP8)]
    table, indices = _weight(W4, 50, 64, 32), torch.tensor([[1, 2]])
    real = [_call(weight, x, None) for weight in weights]
    real.append(octavo.embedding_w4(table.qweight, table.scales, table.offsets, indices, 32, torch.float32))
    with FakeTensorMode() as mode:
        fakes = [_call(_fake(weight, mode), mode.from_tensor(x), None) for weight in weights]
        fake_table = _fake(table, mode)
        fakes.append(octavo.embedding_w4(fake_table.qweight, fake_table.scales, fake_table.offsets,
                                         mode.from_tensor(indices), 32, torch.float32))
    for actual, fake in zip(real, fakes, strict=True):
        assert (fake.shape, fake.dtype) == (actual.shape, actual.dtype)


def test_schemas():
    assert str(octavo.linear_w4.default._schema) == ("octavo::linear_w4(Tensor x, Tensor qweight, Tensor scales, "
                                                     "Tensor offsets, Tensor? bias, SymInt group_size) -> Tensor")
    assert str(octavo.linear_fp8.default._schema) == ("octavo::linear_fp8(Tensor x, Tensor qweight, Tensor scales, "
                                                      "Tensor? bias) -> Tensor")


def test_graph_with_quantized_ops_round_trips_through_onnx():
    w8, w4, fp8 = (_weight(layout, 16, 64, 32, seed) for seed, layout in enumerate((W8, W4, FP8)))
    table = _weight(W8, 40, 64, 64, seed=5)
    graph = torch.fx.Graph()
    ids = graph.placeholder("input_ids")
    inputs = {name: graph.placeholder(name) for name in (
        "table_q", "table_s", "w8_q", "w8_s", "w4_q", "w4_s", "w4_o", "fp8_q", "fp8_s")}
    hidden = graph.call_function(octavo.embedding_w8.default, (inputs["table_q"], inputs["table_s"], ids, 64,
                                                                torch.float32))
    a = graph.call_function(octavo.linear_w8.default, (hidden, inputs["w8_q"], inputs["w8_s"], None, 32))
    b = graph.call_function(octavo.linear_w4.default, (hidden, inputs["w4_q"], inputs["w4_s"], inputs["w4_o"],
                                                       None, 32))
    c = graph.call_function(octavo.linear_fp8.default, (hidden, inputs["fp8_q"], inputs["fp8_s"], None))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (graph.call_function(
        torch.ops.aten.add.Tensor, (a, b)), c)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    values = [torch.tensor([[1, 7, 39]]), table.qweight, table.scales, w8.qweight, w8.scales, w4.qweight, w4.scales,
              w4.offsets, fp8.qweight, fp8.scales]
    FakeTensorProp(gm).propagate(*values)

    model, imported = round_trip(gm)

    custom = {node.op_type: node for node in model.graph.node if node.domain == "ai.octavo"}
    assert {"embedding_w8", "linear_w8", "linear_w4", "linear_fp8"} <= set(custom)
    assert json.loads(custom["linear_w4"].doc_string)["target"] == "octavo::linear_w4.default"
    stored = {value.name: value.type.tensor_type.elem_type for value in model.graph.input}
    assert stored["w4_q"] == onnx.TensorProto.UINT8 and stored["fp8_q"] == onnx.TensorProto.FLOAT8E4M3FN
    assert stored["w4_s"] == onnx.TensorProto.FLOAT16 and stored["table_q"] == onnx.TensorProto.INT8
    assert_same_graph(gm, imported)
    assert torch.equal(imported(*values), gm(*values))
