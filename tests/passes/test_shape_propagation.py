"""Incremental shape propagation: what it recomputes, and that the final full check catches what it cannot see."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from octavo.errors import PassError
from octavo.passes.shape_propagation import (
    adopt_traced_values,
    check_full_propagation,
    describe,
    propagate_all,
    propagate_changed,
)

aten = torch.ops.aten


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hidden = torch.nn.functional.linear(x, w)
    hidden = torch.relu(hidden)
    return hidden.sum(-1)


@pytest.fixture
def graph() -> tuple[GraphModule, FakeTensorMode]:
    module = make_fx(chain)(torch.randn(4, 8), torch.randn(6, 8))
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
    with fake_mode:
        placeholders[0].meta["val"] = torch.empty(4, 8)
        placeholders[1].meta["val"] = torch.empty(6, 8)
    propagate_all(module, fake_mode)
    return module, fake_mode


def node_with(module: GraphModule, target) -> torch.fx.Node:
    return next(node for node in module.graph.nodes if node.target is target)


def test_unchanged_graph_recomputes_nothing(graph):
    module, fake_mode = graph
    assert propagate_changed(module, fake_mode) == 0


def test_new_node_and_its_users_are_recomputed_to_the_full_result(graph):
    module, fake_mode = graph
    relu = node_with(module, aten.relu.default)
    with module.graph.inserting_after(relu):
        # a rewrite that changes the shape seen downstream: [4, 6] -> [4, 6, 1] -> sum(-1) gives [4, 6]
        unsqueezed = module.graph.call_function(aten.unsqueeze.default, (relu, -1))
    total = next(iter(relu.users.keys() - {unsqueezed}))
    total.replace_input_with(relu, unsqueezed)
    recomputed = propagate_changed(module, fake_mode)
    assert recomputed == 2  # the new node, and the sum it now feeds (rewired); relu and linear keep theirs
    assert describe(total.meta["val"]) == ("torch.float32", ("4", "6"))
    check_full_propagation(module, fake_mode)


def test_final_check_catches_a_value_the_incremental_pass_cannot_see(graph):
    module, fake_mode = graph
    relu = node_with(module, aten.relu.default)
    with fake_mode:
        relu.meta["val"] = torch.empty(5, 5)  # stale metadata with unchanged target and arguments
    assert propagate_changed(module, fake_mode) == 0
    with pytest.raises(PassError, match=f"at node {relu.name}"):
        check_full_propagation(module, fake_mode)


def test_a_placeholder_given_another_shape_recomputes_its_users(graph):
    module, fake_mode = graph
    weight = [node for node in module.graph.nodes if node.op == "placeholder"][1]
    with fake_mode:
        weight.meta["val"] = torch.empty(3, 8)  # a pass kept 3 of the 6 output rows (tensor parallelism)
    computed = [node for node in module.graph.nodes if node.op == "call_function"]
    assert propagate_changed(module, fake_mode) == len(computed)  # every node depends on the weight
    assert describe(node_with(module, aten.sum.dim_IntList).meta["val"]) == ("torch.float32", ("4",))
    assert describe(node_with(module, aten.relu.default).meta["val"]) == ("torch.float32", ("4", "3"))
    check_full_propagation(module, fake_mode)


@pytest.fixture
def traced() -> tuple[GraphModule, FakeTensorMode]:
    """A graph traced on fake tensors: every node carries the value the tracer computed."""
    module = make_fx(chain, tracing_mode="fake")(torch.randn(4, 8), torch.randn(6, 8))
    fake_mode = next(node for node in module.graph.nodes if node.op == "placeholder").meta["val"].fake_mode
    return module, fake_mode


def test_traced_values_are_adopted_without_recomputation(traced):
    module, fake_mode = traced
    values = {node: node.meta["val"] for node in module.graph.nodes if node.op == "call_function"}
    assert adopt_traced_values(module, fake_mode) == 0
    assert all(node.meta["val"] is value for node, value in values.items())
    assert propagate_changed(module, fake_mode) == 0
    check_full_propagation(module, fake_mode)


def test_a_node_without_a_traced_value_is_computed(traced):
    module, fake_mode = traced
    del node_with(module, aten.relu.default).meta["val"]
    assert adopt_traced_values(module, fake_mode) == 2  # relu, and the sum it feeds (its input was unknown)
    assert describe(node_with(module, aten.relu.default).meta["val"]) == ("torch.float32", ("4", "6"))
    check_full_propagation(module, fake_mode)


def test_values_of_another_fake_mode_are_propagated_again(traced):
    module, _ = traced
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with fake_mode:
        for node, shape in zip((n for n in module.graph.nodes if n.op == "placeholder"), ((4, 8), (6, 8)), strict=True):
            node.meta["val"] = torch.empty(shape)
    adopt_traced_values(module, fake_mode)
    assert all(node.meta["val"].fake_mode is fake_mode for node in module.graph.nodes if node.op == "call_function")
    check_full_propagation(module, fake_mode)
