"""Graph utilities: op names, histograms, the op-set check and the readable printout."""

from __future__ import annotations

import math
import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule
from torch.fx.experimental.proxy_tensor import make_fx

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from octavo.errors import OctavoError
from octavo.ir.graph import count_ops, find_nodes, format_graph, op_histogram, op_name, verify_graph

aten = torch.ops.aten


@torch.library.custom_op("octavo_test_foreign::double", mutates_args=())
def foreign_double(x: torch.Tensor) -> torch.Tensor:
    """An op of another namespace: outside the Octavo op set."""
    return x * 2


@foreign_double.register_fake
def _(x):
    return torch.empty_like(x)


def graph_of(*calls: tuple) -> GraphModule:
    """x placeholder (f32[2, 3]) followed by `calls` = (target, extra args...) each applied to the previous result."""
    graph = Graph()
    node = graph.placeholder("x")
    for target, *extra in calls:
        node = graph.call_function(target, (node, *extra))
    graph.output(node)
    return GraphModule(torch.nn.Module(), graph)


# ---------------------------------------------------------------------------------------------- names


def test_op_name():
    graph_module = graph_of((aten.relu.default,), (aten.add.Tensor, 1.0), (operator.getitem, 0),
                            (torch.sym_max, 1), (math.ceil,))
    names = [op_name(node) for node in graph_module.graph.nodes]
    assert names == ["placeholder", "aten.relu", "aten.add.Tensor", "operator.getitem", "torch.sym_max",
                     "math.ceil", "output"]


def test_op_histogram_counts_most_frequent_first():
    graph_module = graph_of((aten.neg.default,), (aten.mul.Tensor, 2.0), (aten.relu.default,),
                            (aten.mul.Tensor, 3.0), (aten.add.Tensor, 1.0), (aten.relu.default,),
                            (aten.mul.Scalar, 4.0), (aten.add.Tensor, 1.0), (aten.mul.Tensor, 5.0))
    histogram = op_histogram(graph_module)
    assert list(histogram.items()) == [("aten.mul.Tensor", 3), ("aten.add.Tensor", 2), ("aten.relu", 2),
                                       ("aten.mul.Scalar", 1), ("aten.neg", 1)]


def test_count_ops_matches_any_overload_but_not_prefixes_of_names():
    graph_module = graph_of((aten.mul.Tensor, 2.0), (aten.mul.Scalar, 3.0), (aten.mul.Tensor, 4.0),
                            (aten.mean.default,))
    assert count_ops(graph_module, "aten.mul") == 3
    assert count_ops(graph_module, "aten.mul.Tensor") == 2
    assert count_ops(graph_module, "aten.mu") == 0
    assert count_ops(graph_module, "aten.mean") == 1
    assert [node.args[1] for node in find_nodes(graph_module, aten.mul.Tensor)] == [2.0, 4.0]


# ------------------------------------------------------------------------------------------- printing


def test_format_graph_with_symbolic_shapes_renamed():
    def linear_twice(x, w):
        y = torch.nn.functional.linear(x, w)
        return torch.cat([y, y.relu()], dim=-1).sum(0)

    graph_module = make_fx(linear_twice, tracing_mode="symbolic")(torch.randn(3, 4), torch.randn(5, 4))
    x, w = [node.meta["val"] for node in graph_module.graph.nodes if node.op == "placeholder"]
    names = {str(x.shape[0]): "T", str(x.shape[1]): "H", str(w.shape[0]): "V"}
    assert format_graph(graph_module, names) == (
        "input %x_1: f32[T, H]\n"
        "input %w_1: f32[V, H]\n"
        "%t: f32[H, V] = aten.t(%w_1)\n"
        "%mm: f32[T, V] = aten.mm(%x_1, %t)\n"
        "%relu: f32[T, V] = aten.relu(%mm)\n"
        "%cat: f32[T, 2*V] = aten.cat([%mm, %relu], -1)\n"
        "%sum_1: f32[2*V] = aten.sum.dim_IntList(%cat, [0])\n"
        "return %sum_1\n"
    )


def test_format_graph_arguments_kwargs_and_missing_meta():
    graph = Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(2, 3)
        cast = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
        cast.meta["val"] = torch.empty(2, 3, dtype=torch.bfloat16)
    scaled = graph.call_function(aten.mul.Tensor, (cast, 0.5))  # no meta: printed as "?"
    graph.output((scaled, cast))
    assert format_graph(GraphModule(torch.nn.Module(), graph)) == (
        "input %x: f32[2, 3]\n"
        "%_to_copy_default: bf16[2, 3] = aten._to_copy(%x, dtype=bf16)\n"
        "%mul_tensor: ? = aten.mul.Tensor(%_to_copy_default, 0.5)\n"
        "return (%mul_tensor, %_to_copy_default)\n"
    )


# ------------------------------------------------------------------------------------------- verifying


def local_floor(x):
    return x


@pytest.mark.parametrize(("allowed", "look_alike", "extra"), [
    (aten.relu.default, torch.relu, ()),  # the ATen op, and the torch function of the same name
    (torch.ops.prims.convert_element_type.default, foreign_double._opoverload, (torch.float64,)),
    (operator.mul, torch.mul, (2,)),
    (math.floor, local_floor, ()),
    (torch.sym_max, torch.max, (1,)),  # of module torch only the symbolic-size helpers
])
def test_verify_accepts_each_kind_of_the_op_set_and_not_its_look_alike(allowed, look_alike, extra):
    """The same one-node graph passes with the allowed target and fails, naming the node, with the other."""
    verify_graph(graph_of((allowed, *extra)))  # raises OctavoError if it is not accepted
    with pytest.raises(OctavoError, match=r"graph node \w+ calls .* outside the Octavo op set"):
        verify_graph(graph_of((look_alike, *extra)))


def test_verify_accepts_a_traced_aten_graph_and_rejects_it_after_one_foreign_call():
    traced = make_fx(lambda x: torch.nn.functional.linear(x, x).softmax(-1))(torch.randn(3, 3))
    ops = op_histogram(traced)
    assert ops and all(name.startswith("aten.") for name in ops), ops
    verify_graph(traced)
    softmax = next(node for node in traced.graph.nodes if op_name(node).startswith("aten._softmax"))
    softmax.target = torch.softmax
    with pytest.raises(OctavoError, match=rf"graph node {softmax.name} calls"):
        verify_graph(traced)


def test_verify_accepts_octavo_ops():
    def attend(query, key, value, key_cache, value_cache, slots, tables, lens, starts):
        return torch.ops.octavo.paged_attention(query, key, value, key_cache, value_cache, slots, tables, lens,
                                                starts, 1.0, -1)

    inputs = (torch.randn(2, 2, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.zeros(1, 16, 1, 4),
              torch.zeros(1, 16, 1, 4), torch.arange(2), torch.zeros(1, 1, dtype=torch.int32),
              torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    graph_module = make_fx(attend)(*inputs)
    assert count_ops(graph_module, "octavo.paged_attention") == 1
    verify_graph(graph_module)
    attention = find_nodes(graph_module, torch.ops.octavo.paged_attention.default)[0]
    attention.target = foreign_double._opoverload  # the same node, an op of another namespace
    with pytest.raises(OctavoError, match=rf"graph node {attention.name} calls .*octavo_test_foreign"):
        verify_graph(graph_module)


def local_helper(x):
    return x


@pytest.mark.parametrize(("target", "shown"), [
    (foreign_double._opoverload, "octavo_test_foreign.double"),
    (torch.relu, "relu"),  # module torch, but not an ATen op
    (local_helper, "local_helper"),
])
def test_verify_rejects_calls_outside_the_op_set(target, shown):
    with pytest.raises(OctavoError, match=rf"graph node \w+ calls .*{shown}.*outside the Octavo op set") as caught:
        verify_graph(graph_of((aten.relu.default,), (target,)))
    assert "\n" not in str(caught.value)


def test_verify_rejects_call_module_and_call_method():
    modules = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(OctavoError, match="is a call_module; only call_function is allowed"):
        verify_graph(modules)

    class Method(torch.nn.Module):
        def forward(self, x):
            return x.relu()

    with pytest.raises(OctavoError, match="is a call_method; only call_function is allowed"):
        verify_graph(torch.fx.symbolic_trace(Method()))


def test_verify_rejects_a_graph_that_fails_lint():
    graph_module = graph_of((aten.neg.default,), (aten.relu.default,))
    negate, relu = find_nodes(graph_module, aten.neg.default)[0], find_nodes(graph_module, aten.relu.default)[0]
    negate.prepend(relu)  # relu now reads neg before neg is computed
    with pytest.raises(OctavoError, match="graph failed verification"):
        verify_graph(graph_module)
