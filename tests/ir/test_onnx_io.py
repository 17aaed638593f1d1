"""graph.onnx round trips: FX graph -> ONNX -> the identical FX graph, and valid ONNX on the way."""

from __future__ import annotations

import json
import math
import operator

import onnx
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from octavo.ir.onnx_io import export_graph_to_onnx, import_graph_from_onnx, save_onnx
from tests.ir.onnx_round_trip_helpers import (
    TOKEN_SPECS,
    assert_bitwise_equal,
    assert_same_graph,
    onnx_node,
    program_inputs,
    round_trip,
    small_matrix,
    trace_hf,
)

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama_program():
    return trace_hf(LlamaForCausalLM, LlamaConfig)


@pytest.fixture(scope="module")
def qwen2_program():
    return trace_hf(Qwen2ForCausalLM, Qwen2Config)


# ------------------------------------------------------------------------------ traced HF models


@pytest.mark.parametrize("program_fixture", ["llama_program", "qwen2_program"])
def test_traced_model_round_trips_to_identical_graph_and_bitwise_outputs(program_fixture, request):
    program = request.getfixturevalue(program_fixture)
    gm = program.graph_module
    model, imported = round_trip(gm, TOKEN_SPECS)

    assert_same_graph(gm, imported)
    placeholders = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    assert [value.name for value in model.graph.input] == placeholders
    assert len(model.graph.initializer) == 0
    for length in (5, 13):
        torch.manual_seed(length)
        inputs = program_inputs(program, torch.randint(0, 128, (length,)), torch.arange(length))
        expected = gm(*inputs)
        assert expected[0].shape == (length, 128)
        assert_bitwise_equal(imported(*inputs), expected)


def test_traced_model_is_a_normal_onnx_model_with_standard_ops_where_exact(llama_program):
    gm = llama_program.graph_module
    model = export_graph_to_onnx(gm, TOKEN_SPECS, graph_name="tiny_llama")

    assert {(o.domain, o.version) for o in model.opset_import} == {("", 18), ("ai.octavo", 1)}
    assert model.graph.name == "tiny_llama"
    by_target: dict[str, set[tuple[str, str]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            proto = onnx_node(model, node.name)
            by_target.setdefault(str(node.target), set()).add((proto.domain, proto.op_type))
    assert by_target["aten.embedding.default"] == {("", "Gather")}
    assert by_target["aten.mul.Tensor"] == {("", "Mul")}
    assert by_target["aten.unsqueeze.default"] == {("", "Unsqueeze")}
    assert by_target["aten.cat.default"] == {("", "Concat")}
    assert by_target["aten.pow.Tensor_Scalar"] == {("", "Pow")}
    assert by_target["aten._to_copy.default"] == {("", "Cast")}
    assert by_target["aten.transpose.int"] == {("", "Transpose")}
    assert by_target["aten.cos.default"] == {("", "Cos")}
    assert by_target["aten.linear.default"] == {("ai.octavo", "aten_linear")}
    assert by_target["aten.rsqrt.default"] == {("ai.octavo", "aten_rsqrt")}
    assert by_target["aten.view.default"] == {("ai.octavo", "aten_view")}
    assert by_target["aten.sym_size.int"] == {("ai.octavo", "sym_size")}

    embedding = next(n for n in gm.graph.nodes if n.target is aten.embedding.default)
    gather = onnx_node(model, embedding.name)
    assert list(gather.input) == [embedding.args[0].name, embedding.args[1].name]
    assert [(a.name, a.i) for a in gather.attribute] == [("axis", 0)]
    assert json.loads(gather.doc_string)["target"] == "aten::embedding.default"

    # The spec's symbol "T" replaces the export symbol everywhere, also inside the graph.
    types = {v.name: v.type.tensor_type for v in model.graph.value_info}
    assert [d.dim_param or d.dim_value for d in types[embedding.name].shape.dim] == [1, "T", 64]
    sym_size = next(n for n in gm.graph.nodes if n.target is aten.sym_size.int)
    assert types[sym_size.name].elem_type == onnx.TensorProto.INT64
    assert len(types[sym_size.name].shape.dim) == 0
    weight = next(v for v in model.graph.input if v.name == "p_model_lm_head_weight")
    assert weight.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in weight.type.tensor_type.shape.dim] == [128, 64]


# ------------------------------------------------------------------------ hand-made FX graphs


def paged_attention_inputs():
    torch.manual_seed(0)
    tokens, query_heads, kv_heads, head_dim, blocks, block_size = 5, 4, 2, 8, 4, 4
    return [
        torch.randn(tokens, query_heads, head_dim),
        torch.randn(tokens, kv_heads, head_dim),
        torch.randn(tokens, kv_heads, head_dim),
        torch.zeros(blocks, block_size, kv_heads, head_dim),
        torch.zeros(blocks, block_size, kv_heads, head_dim),
        torch.tensor([4, 5, 6, 8, 9], dtype=torch.int64),  # sequence 0: 3 tokens, sequence 1: 2 tokens
        torch.tensor([[1, 0], [2, 0]], dtype=torch.int32),
        torch.tensor([3, 2], dtype=torch.int32),
        torch.tensor([0, 3, 5], dtype=torch.int32),
    ]


def test_mutating_custom_op_keeps_its_place_and_its_in_place_writes():
    graph = torch.fx.Graph()
    names = ["query", "key", "value", "key_cache", "value_cache", "slot_mapping", "block_tables", "seq_lens",
             "query_start_loc"]
    q, k, v, key_cache, value_cache, *metadata = [graph.placeholder(name) for name in names]
    # The first call only writes the caches (its result is unused); the second reads them.
    first = graph.call_function(torch.ops.octavo.paged_attention.default,
                                (q, k, v, key_cache, value_cache, *metadata), {"scale": 0.25})
    doubled_key = graph.call_function(aten.mul.Tensor, (k, 2.0))
    second = graph.call_function(torch.ops.octavo.paged_attention.default,
                                 (q, doubled_key, v, key_cache, value_cache, *metadata),
                                 {"scale": 0.5, "sliding_window": 2})
    graph.output(second)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    FakeTensorProp(gm).propagate(*paged_attention_inputs())

    model, imported = round_trip(gm, {"key_cache": (torch.float32, ["num_blocks", 4, 2, 8])})

    custom = [n for n in model.graph.node if n.domain == "ai.octavo"]
    assert [n.op_type for n in custom] == ["paged_attention", "paged_attention"]
    assert [n.name for n in custom] == [first.name, second.name]
    assert list(custom[0].output) == [first.name]
    assert json.loads(custom[0].doc_string)["target"] == "octavo::paged_attention.default"
    assert_same_graph(gm, imported)
    expected_inputs, actual_inputs = paged_attention_inputs(), paged_attention_inputs()
    expected = gm(*expected_inputs)
    actual = imported(*actual_inputs)
    assert_bitwise_equal(actual, expected)
    assert expected_inputs[3].abs().sum() > 0  # the caches were written
    assert_bitwise_equal(actual_inputs[3:5], expected_inputs[3:5])


def test_quantized_kv_cache_and_16_bit_weight_ops_round_trip():
    """paged_attention with int8 caches and their scale caches, and linear_w16 over a bf16 weight."""
    graph = torch.fx.Graph()
    names = ["query", "key", "value", "key_cache", "value_cache", "slot_mapping", "block_tables", "seq_lens",
             "query_start_loc", "key_scale_cache", "value_scale_cache", "weight"]
    q, k, v, key_cache, value_cache, *metadata, key_scales, value_scales, weight = [graph.placeholder(name)
                                                                                      for name in names]
    attention = graph.call_function(torch.ops.octavo.paged_attention.default, (q, k, v, key_cache, value_cache,
                                                                               *metadata, 0.25),
                                    {"key_scale_cache": key_scales, "value_scale_cache": value_scales})
    flat = graph.call_function(aten.view.default, (attention, [5, 32]))
    graph.output(graph.call_function(torch.ops.octavo.linear_w16.default, (flat, weight)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    def inputs():
        values = paged_attention_inputs()
        values[3], values[4] = (torch.zeros(4, 4, 2, 8, dtype=torch.int8) for _ in range(2))
        return [*values, torch.ones(4, 4, 2), torch.ones(4, 4, 2),
                torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)]

    FakeTensorProp(gm).propagate(*inputs())
    model, imported = round_trip(gm)
    custom = [n.op_type for n in model.graph.node if n.domain == "ai.octavo"]
    assert custom == ["paged_attention", "linear_w16"]
    assert_same_graph(gm, imported)
    expected_inputs, actual_inputs = inputs(), inputs()
    assert_bitwise_equal(imported(*actual_inputs), gm(*expected_inputs))
    assert expected_inputs[9].ne(1).any()  # scales were written
    assert_bitwise_equal(actual_inputs[3:5] + actual_inputs[9:11], expected_inputs[3:5] + expected_inputs[9:11])


def test_multi_output_ops_become_one_onnx_node_and_getitems_come_back_in_place():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    parts = graph.call_function(aten.split_with_sizes.default, (x, [1, 2, 1], 1))
    stats = graph.call_function(aten.var_mean.correction, (x, [1]), {"correction": 0, "keepdim": True})
    negated = graph.call_function(aten.neg.default, (x,))
    third = graph.call_function(operator.getitem, (parts, 2))
    mean = graph.call_function(operator.getitem, (stats, 1))
    first = graph.call_function(operator.getitem, (parts, 0))
    first_again = graph.call_function(operator.getitem, (parts, 0))  # a second getitem of one result
    total = graph.call_function(aten.add.Tensor, (first, third))
    graph.output((total, mean, first_again, negated))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x_value = small_matrix()
    FakeTensorProp(gm).propagate(x_value)

    model, imported = round_trip(gm)

    split = onnx_node(model, parts.name)
    assert split.op_type == "Split"
    assert list(split.output) == [first.name, f"{parts.name}.unused1", third.name]
    var_mean = onnx_node(model, stats.name)
    assert (var_mean.domain, var_mean.op_type) == ("ai.octavo", "aten_var_mean_correction")
    assert list(var_mean.output) == [f"{stats.name}.unused0", mean.name]
    assert onnx_node(model, first_again.name).op_type == "Identity"
    assert_same_graph(gm, imported)
    assert_bitwise_equal(imported(x_value), gm(x_value))


def test_symint_arithmetic_and_literal_arguments_round_trip():
    def fn(x, y):
        rows = x.shape[0]
        flat = x.reshape(rows * 2, -1)
        filled = x.new_full((rows // 2 + 1, y.shape[1]), float("-inf"), dtype=torch.bfloat16)
        return flat, filled, flat.sum(0) * math.inf

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(6, 4), torch.randn(2, 3))
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    with graph.inserting_before(output):
        nan_node = graph.call_function(aten.full.default, ([2], float("nan")), {
            "dtype": torch.float16, "layout": torch.strided, "device": torch.device("cpu"),
            "pin_memory": False,
        })
        contiguous = graph.call_function(aten.clone.default, (nan_node,),
                                         {"memory_format": torch.contiguous_format})
    output.args = ((*output.args[0], contiguous),)
    gm.recompile()

    model, imported = round_trip(gm)

    assert_same_graph(gm, imported)
    for x_rows in (4, 10):
        inputs = (torch.randn(x_rows, 4), torch.randn(2, 5))
        actual, expected = imported(*inputs), gm(*inputs)
        assert_bitwise_equal(actual[:3], expected[:3])
        assert actual[3].dtype == expected[3].dtype == torch.float16
        assert torch.isnan(actual[3]).all() and torch.isnan(expected[3]).all()
    mul_sym = next(n for n in gm.graph.nodes if n.target is operator.mul)
    assert (onnx_node(model, mul_sym.name).domain, onnx_node(model, mul_sym.name).op_type) == (
        "ai.octavo", "operator_mul")
    assert json.loads(onnx_node(model, mul_sym.name).doc_string)["target"] == "_operator.mul"
    symint_types = {v.name: v.type.tensor_type for v in model.graph.value_info}[mul_sym.name]
    assert symint_types.elem_type == onnx.TensorProto.INT64 and len(symint_types.shape.dim) == 0
    # Templates are strict JSON: non-finite floats are spelled out, never bare NaN/Infinity.
    for node in model.graph.node:
        json.loads(node.doc_string, parse_constant=lambda token: pytest.fail(f"bare {token} in template"))
    assert '{"$float": "-inf"}' in "".join(n.doc_string for n in model.graph.node)


def test_graph_without_meta_round_trips_with_undefined_types(tmp_path):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y")
    product = graph.call_function(aten.mul.Tensor, (x, y))
    graph.output([product, x])
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    model = export_graph_to_onnx(gm, {"y": (torch.float32, [3, "N"])})
    onnx.checker.check_model(model, full_check=True)
    save_onnx(model, tmp_path / "graph.onnx")
    imported = import_graph_from_onnx(tmp_path / "graph.onnx")

    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED
    assert [d.dim_value or d.dim_param for d in model.graph.input[1].type.tensor_type.shape.dim] == [3, "N"]
    assert onnx_node(model, product.name).domain == "ai.octavo"  # without dtypes no standard op is safe
    assert_same_graph(gm, imported)
    x_value, y_value = torch.randn(3, 2), torch.randn(3, 2)
    assert_bitwise_equal(imported(x_value, y_value), gm(x_value, y_value))
    assert_same_graph(gm, import_graph_from_onnx(str(tmp_path / "graph.onnx")))


