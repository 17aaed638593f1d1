"""graph.onnx: ops written as standard ONNX ops compute exactly what their ATen op computes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from onnx.reference import ReferenceEvaluator
from torch.fx.experimental.proxy_tensor import make_fx

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from tests.ir.onnx_round_trip_helpers import (
    assert_bitwise_equal,
    assert_same_graph,
    onnx_node,
    round_trip,
    small_matrix,
)

aten = torch.ops.aten

# ----------------------------------------------------------------- standard ops match ATen exactly


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
    gm = make_fx(fn, tracing_mode="fake")(small_matrix())
    model, imported = round_trip(gm)

    node = next(n for n in gm.graph.nodes if str(n.target) == fx_target)
    assert (onnx_node(model, node.name).domain, onnx_node(model, node.name).op_type) == ("", op_type)
    assert all(n.domain == "" for n in model.graph.node)
    (onnx_result,) = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: small_matrix().numpy()})
    expected = fn(small_matrix())
    np.testing.assert_allclose(onnx_result, expected.numpy(), rtol=1e-6, atol=0)
    assert onnx_result.dtype == expected.numpy().dtype
    assert_same_graph(gm, imported)


def test_index_gathers_match_aten():
    def fn(table, ids):
        return torch.index_select(table, 1, ids) + torch.nn.functional.embedding(ids, table.T)[:, :3].T

    table, ids = small_matrix(), torch.tensor([2, 0, 3])
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
    x = (small_matrix() * 4).to(dtype)
    gm = make_fx(fn, tracing_mode="fake")(x)
    model, imported = round_trip(gm)
    last_call = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    assert onnx_node(model, last_call.name).domain == "ai.octavo"
    assert_same_graph(gm, imported)
    assert_bitwise_equal(imported(x), fn(x))


