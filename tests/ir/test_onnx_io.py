"""graph.onnx round trips: FX graph -> ONNX -> the identical FX graph, and valid ONNX on the way."""

from __future__ import annotations

import json
import math
import operator
import re

import numpy as np
import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from octavo.errors import ArtifactError
from octavo.ir.onnx_io import export_graph_to_onnx, import_graph_from_onnx, save_onnx

aten = torch.ops.aten


# ------------------------------------------------------------------------------------- helpers


def round_trip(gm: torch.fx.GraphModule, input_specs=None) -> tuple[onnx.ModelProto, torch.fx.GraphModule]:
    """Export, check with the full ONNX checker, serialize to bytes, parse, import."""
    model = export_graph_to_onnx(gm, input_specs)
    onnx.checker.check_model(model, full_check=True)
    parsed = onnx.load_model_from_string(model.SerializeToString())
    return model, import_graph_from_onnx(parsed)


def describe(value):
    """A comparable description of an FX argument that keeps list/tuple/int/float/bool apart."""
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(describe(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((key, describe(item)) for key, item in value.items()))
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def graph_description(gm: torch.fx.GraphModule) -> list[tuple]:
    return [
        (node.op, node.name, node.target, describe(node.args), describe(dict(node.kwargs)))
        for node in gm.graph.nodes
    ]


def assert_same_graph(original: torch.fx.GraphModule, imported: torch.fx.GraphModule) -> None:
    assert graph_description(imported) == graph_description(original)


def assert_bitwise_equal(actual, expected) -> None:
    if isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_bitwise_equal(a, e)
    else:
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def onnx_node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(node for node in model.graph.node if node.name == name)


def trace_hf(model_class, config_class, **extra):
    config = config_class(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, **extra,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_class(config).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.m = inner

        def forward(self, input_ids, positions):
            return self.m(
                input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False
            ).logits[0]

    length = torch.export.Dim("T", min=2)
    program = torch.export.export(
        Wrapper(model), (torch.randint(0, 128, (7,)), torch.arange(7)),
        dynamic_shapes={"input_ids": {0: length}, "positions": {0: length}}, strict=False,
    )
    return program.run_decompositions({})


def program_inputs(program, input_ids, positions) -> list[torch.Tensor]:
    """The graph's positional inputs: weights from the state dict / constants, then the tokens."""
    tensors = {**program.state_dict, **program.constants}
    values = []
    for spec in program.graph_signature.input_specs:
        if spec.arg.name == "input_ids":
            values.append(input_ids)
        elif spec.arg.name == "positions":
            values.append(positions)
        else:
            values.append(tensors[spec.target])
    return values


TOKEN_SPECS = {"input_ids": (torch.int64, ["T"]), "positions": (torch.int64, ["T"])}


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
    weight = next(v for v in model.graph.input if v.name == "p_m_lm_head_weight")
    assert weight.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in weight.type.tensor_type.shape.dim] == [128, 64]


# ----------------------------------------------------------------- standard ops match ATen exactly


def _x():
    return torch.tensor([[0.5, -1.25, 2.0, 3.5], [-0.75, 1.5, -2.5, 0.25], [1.0, -3.0, 0.125, 4.0]])


STANDARD_CASES = [
    ("add", lambda x: x + torch.sin(x), "aten.add.Tensor", "Add"),
    ("add_scalar", lambda x: x + 0.1, "aten.add.Tensor", "Add"),
    ("sub", lambda x: x - 2, "aten.sub.Tensor", "Sub"),
    ("mul", lambda x: x * x, "aten.mul.Tensor", "Mul"),
    ("div", lambda x: x / 3.0, "aten.div.Tensor", "Div"),
    ("pow", lambda x: x ** 2, "aten.pow.Tensor_Scalar", "Pow"),
    ("neg", lambda x: -x, "aten.neg.default", "Neg"),
    ("exp", torch.exp, "aten.exp.default", "Exp"),
    ("sqrt", lambda x: x.abs().sqrt(), "aten.sqrt.default", "Sqrt"),
    ("cos", torch.cos, "aten.cos.default", "Cos"),
    ("sin", torch.sin, "aten.sin.default", "Sin"),
    ("sigmoid", torch.sigmoid, "aten.sigmoid.default", "Sigmoid"),
    ("tanh", torch.tanh, "aten.tanh.default", "Tanh"),
    ("relu", torch.relu, "aten.relu.default", "Relu"),
    ("reciprocal", torch.reciprocal, "aten.reciprocal.default", "Reciprocal"),
    ("permute", lambda x: x.permute(1, 0), "aten.permute.default", "Transpose"),
    ("cat", lambda x: torch.cat([x, -x], -1), "aten.cat.default", "Concat"),
    ("select", lambda x: x[:, -1], "aten.select.int", "Gather"),
    ("slice", lambda x: x[:, 1::2], "aten.slice.Tensor", "Slice"),
    ("unsqueeze", lambda x: x.unsqueeze(-1), "aten.unsqueeze.default", "Unsqueeze"),
    ("squeeze", lambda x: x[:, :1].squeeze(1), "aten.squeeze.dim", "Squeeze"),
    ("view", lambda x: x.view(2, -1), "aten.view.default", "Reshape"),
    ("expand", lambda x: x[:1].expand(2, 4), "aten.expand.default", "Expand"),
    ("mm", lambda x: x @ x.T, "aten.mm.default", "MatMul"),
    ("softmax", lambda x: torch.softmax(x, -1), "aten._softmax.default", "Softmax"),
    ("log_softmax", lambda x: torch.log_softmax(x, 0), "aten._log_softmax.default", "LogSoftmax"),
    ("mean", lambda x: x.mean(-1, keepdim=True), "aten.mean.dim", "ReduceMean"),
    ("sum", lambda x: x.sum([0]), "aten.sum.dim_IntList", "ReduceSum"),
    ("amax", lambda x: x.amax(1), "aten.amax.default", "ReduceMax"),
    ("where", lambda x: torch.where(x > 0, x, -x), "aten.where.self", "Where"),
    ("less_equal", lambda x: x <= 0.5, "aten.le.Scalar", "LessOrEqual"),
    ("equal", lambda x: x == x.abs(), "aten.eq.Tensor", "Equal"),
    ("and", lambda x: (x > 0) & (x < 2), "aten.bitwise_and.Tensor", "And"),
    ("cast", lambda x: (x * 4).to(torch.int32), "aten._to_copy.default", "Cast"),
    ("clone", lambda x: x.clone(), "aten.clone.default", "Identity"),
    ("split", lambda x: torch.split(x, [1, 3], dim=1)[1], "aten.split_with_sizes.default", "Split"),
]


@pytest.mark.parametrize(("fx_target", "op_type", "fn"), [(c[2], c[3], c[1]) for c in STANDARD_CASES],
                         ids=[c[0] for c in STANDARD_CASES])
def test_standard_op_computes_what_the_aten_op_computes(fx_target, op_type, fn):
    gm = make_fx(fn, tracing_mode="fake")(_x())
    model, imported = round_trip(gm)

    node = next(n for n in gm.graph.nodes if str(n.target) == fx_target)
    assert (onnx_node(model, node.name).domain, onnx_node(model, node.name).op_type) == ("", op_type)
    assert all(n.domain == "" for n in model.graph.node)
    (onnx_result,) = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: _x().numpy()})
    expected = fn(_x())
    np.testing.assert_allclose(onnx_result, expected.numpy(), rtol=1e-6, atol=0)
    assert onnx_result.dtype == expected.numpy().dtype
    assert_same_graph(gm, imported)


def test_index_gathers_match_aten():
    def fn(table, ids):
        return torch.index_select(table, 1, ids) + torch.nn.functional.embedding(ids, table.T)[:, :3].T

    table, ids = _x(), torch.tensor([2, 0, 3])
    gm = make_fx(fn, tracing_mode="fake")(table, ids)
    model, imported = round_trip(gm)
    gathers = [n for n in model.graph.node if n.op_type == "Gather"]
    assert {json.loads(n.doc_string)["target"] for n in gathers} == {
        "aten::index_select.default", "aten::embedding.default"}
    (onnx_result,) = ReferenceEvaluator(model).run(None, {"table_1": table.numpy(), "ids_1": ids.numpy()})
    np.testing.assert_array_equal(onnx_result, fn(table, ids).numpy())
    assert_same_graph(gm, imported)


@pytest.mark.parametrize(("name", "fn", "dtype"), [
    ("int_true_division", lambda x: x / 2, torch.int64),  # ATen promotes to float, ONNX Div does not
    ("add_with_alpha", lambda x: torch.add(x, x, alpha=2), torch.float32),
    ("bf16_inexact_scalar", lambda x: x + 0.1, torch.bfloat16),  # ATen adds 0.1 in float32
    ("mixed_dtypes", lambda x: x + x.to(torch.float64), torch.float32),
    ("squeeze_non_unit_dim", lambda x: x.squeeze(1), torch.float32),  # ATen no-op, ONNX error
    ("expand_minus_one", lambda x: x[:1].expand(-1, 4), torch.float32),
    ("bf16_cos", torch.cos, torch.bfloat16),  # ONNX Cos has no bfloat16
])
def test_ops_without_exact_onnx_equivalent_stay_custom(name, fn, dtype):
    x = (_x() * 4).to(dtype)
    gm = make_fx(fn, tracing_mode="fake")(x)
    model, imported = round_trip(gm)
    last_call = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    assert onnx_node(model, last_call.name).domain == "ai.octavo"
    assert_same_graph(gm, imported)
    assert_bitwise_equal(imported(x), fn(x))


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
    x_value = _x()
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


# ------------------------------------------------------------------------------------- errors


def _single_op_graph(target, args, kwargs=None) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(target, tuple(x if a is None else a for a in args), kwargs or {})
    graph.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@torch.library.custom_op("octavo_onnx_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize(("gm", "message"), [
    (_single_op_graph(torch.ops.octavo_onnx_test.double.default, [None]), "cannot be stored in graph.onnx"),
    (_single_op_graph(torch.add, [None, None]), "cannot be stored in graph.onnx"),
    (_single_op_graph(aten.add.Tensor, [None, None], {"alpha": slice(1)}), "argument slice"),
])
def test_export_rejects_unstorable_targets_and_arguments(gm, message):
    with pytest.raises(ArtifactError, match=message):
        export_graph_to_onnx(gm)


def test_export_rejects_get_attr_nodes_and_unknown_input_specs():
    root = torch.nn.Module()
    root.weight = torch.nn.Parameter(torch.ones(2))
    graph = torch.fx.Graph()
    graph.output(graph.get_attr("weight"))
    with pytest.raises(ArtifactError, match="get_attr nodes are not supported"):
        export_graph_to_onnx(torch.fx.GraphModule(root, graph))
    with pytest.raises(ArtifactError, match=r"input_specs names \['z'\]"):
        export_graph_to_onnx(_single_op_graph(aten.neg.default, [None]), {"z": (torch.float32, [1])})


def _exported_neg() -> onnx.ModelProto:
    return export_graph_to_onnx(_single_op_graph(aten.neg.default, [None]))


@pytest.mark.parametrize("bad_target", ["aten::no_such_op.default", "builtins.eval", "os.system",
                                        "torch.load", "mylib::neg.default", "aten::neg.__class__"])
def test_import_rejects_ops_it_does_not_know(bad_target):
    model = _exported_neg()
    node = model.graph.node[0]
    template = json.loads(node.doc_string)
    node.doc_string = json.dumps({**template, "target": bad_target})
    expected = f"graph.onnx node neg_default uses op {bad_target} which this Octavo version does not know"
    with pytest.raises(ArtifactError, match=re.escape(expected)):
        import_graph_from_onnx(model)


def test_import_rejects_models_that_are_not_octavo_graphs():
    plain = _exported_neg()
    del plain.metadata_props[:]
    with pytest.raises(ArtifactError, match="not an Octavo graph"):
        import_graph_from_onnx(plain)

    no_template = _exported_neg()
    no_template.graph.node[0].doc_string = ""
    with pytest.raises(ArtifactError, match="node neg_default has no Octavo template"):
        import_graph_from_onnx(no_template)

    bad_reference = _exported_neg()
    bad_reference.graph.node[0].doc_string = json.dumps({"target": "aten::neg.default", "args": [{"$in": 3}]})
    with pytest.raises(ArtifactError, match="refers to missing input 3"):
        import_graph_from_onnx(bad_reference)
