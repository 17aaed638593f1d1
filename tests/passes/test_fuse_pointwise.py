"""fuse_pointwise, the partitioner on FX graphs: leftover pointwise ops -> octavo.fused_pointwise, same outputs."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.ir.ops.fused_pointwise import ALLOWED_OPS, REDUCTION_OPS
from octavo.passes import run_pipeline
from tests.passes.fusion_harness import (
    ALL_PASSES,
    BASE_PASSES,
    DTYPES,
    FUSION_PASSES,
    MODEL_TYPES,
    assert_bitwise_equal,
    compiled,
    make_graph,
    outputs,
    run_plain,
)
from tests.tiny_models import COMMON

LAYERS = COMMON["num_hidden_layers"]
PASS = "fuse_pointwise"
ONLY_PARTITIONER = (*BASE_PASSES, PASS)
PATTERN_PASSES = tuple(name for name in FUSION_PASSES if name != PASS)


def programs(result) -> list[list[dict]]:
    return [json.loads(node.args[1]) for node in result.graph_module.graph.nodes
            if node.target is torch.ops.octavo.fused_pointwise.default]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_after_the_pattern_passes_nothing_is_left_to_fuse(model_type):
    result = compiled(model_type, "bfloat16", tuple(ALL_PASSES))
    assert result.stats(PASS) == {"groups": 0, "fused_nodes": 0, "with_reduction": 0, "largest": 0}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_alone_it_fuses_each_decomposed_norm_into_one_group_with_its_reduction(model_type):
    before = compiled(model_type, "bfloat16", tuple(BASE_PASSES))
    after = compiled(model_type, "bfloat16", ONLY_PARTITIONER)
    norms = 2 * LAYERS + 1 + (2 * LAYERS if model_type == "qwen3" else 0)
    stats = after.stats(PASS)
    assert stats["with_reduction"] == norms and after.count("aten.mean") == 0
    assert after.count("octavo.fused_pointwise") == stats["groups"] > norms  # rope and silu*mul groups too
    assert stats["fused_nodes"] == len(before.graph_module.graph.nodes) - len(after.graph_module.graph.nodes) + \
        stats["groups"]
    for program in programs(after):
        assert len(program) >= 2
        assert all(step["op"] in ALLOWED_OPS for step in program)
        assert sum(step["op"] in REDUCTION_OPS for step in program) <= 1
    # One norm's program is the LlamaRMSNorm op sequence.
    norm = next(program for program in programs(after) if any(step["op"] == "aten.mean.dim" for step in program))
    assert [step["op"] for step in norm] == [
        "aten._to_copy.default", "aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor",
        "aten.rsqrt.default", "aten.mul.Tensor", "aten._to_copy.default", "aten.mul.Tensor"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outputs_bitwise_equal_before_and_after(model_type, dtype):
    assert_bitwise_equal(outputs(model_type, dtype, tuple(BASE_PASSES)), outputs(model_type, dtype, ONLY_PARTITIONER))


def test_disabling_the_pattern_passes_leaves_their_work_to_the_partitioner():
    result = compiled("llama", "float32", tuple(ALL_PASSES), PATTERN_PASSES)
    assert [record["name"] for record in result.ctx.history] == [*BASE_PASSES, PASS]
    assert result.stats(PASS)["groups"] > 0


UNARY = ["neg", "exp", "sigmoid", "silu", "tanh", "rsqrt_abs", "relu", "square"]
BINARY = ["add", "mul", "sub", "maximum"]
BARRIERS = ["flip", "cumsum"]  # not pointwise: the partitioner must route groups around them


def apply(kind: str, operands: list[torch.Tensor]) -> torch.Tensor:
    first = operands[0]
    second = operands[1] if len(operands) > 1 else first
    table = {
        "neg": lambda: -first, "exp": lambda: torch.exp(first.clamp(max=5)), "sigmoid": lambda: torch.sigmoid(first),
        "silu": lambda: torch.nn.functional.silu(first), "tanh": lambda: torch.tanh(first),
        "rsqrt_abs": lambda: torch.rsqrt(first.abs() + 1.0), "relu": lambda: torch.relu(first),
        "square": lambda: first.pow(2), "add": lambda: first + second, "mul": lambda: first * second,
        "sub": lambda: first - second, "maximum": lambda: torch.maximum(first, second),
        "mean": lambda: first.mean(-1, keepdim=True), "flip": lambda: first.flip(-1),
        "cumsum": lambda: first.cumsum(-1), "to_bf16": lambda: first.to(torch.bfloat16).to(torch.float32),
    }
    return table[kind]()


@st.composite
def random_programs(draw):
    """Up to 14 ops over 3 inputs, each reading earlier values; a few values become extra outputs."""
    kinds = st.sampled_from([*UNARY, *BINARY, *BARRIERS, "mean", "to_bf16"])
    length = draw(st.integers(2, 14))
    operations = []
    for index in range(length):
        kind = draw(kinds)
        available = 3 + index
        operations.append((kind, draw(st.integers(0, available - 1)), draw(st.integers(0, available - 1))))
    extra_outputs = draw(st.lists(st.integers(3, 3 + length - 1), max_size=3, unique=True))
    return operations, extra_outputs


def build_function(operations, extra_outputs):
    def function(x, y, row_scale):
        values = [x, y, row_scale]
        for kind, first, second in operations:
            values.append(apply(kind, [values[first], values[second]]))
        return [values[-1], *(values[index] for index in extra_outputs)]

    return function


@settings(max_examples=60, deadline=None)
@given(random_programs())
def test_random_pointwise_programs_keep_their_outputs_and_the_graph_acyclic(case):
    operations, extra_outputs = case
    generator = torch.Generator().manual_seed(len(operations))
    inputs = {"x": torch.randn(3, 8, generator=generator), "y": torch.randn(3, 8, generator=generator),
              "row_scale": torch.randn(3, 1, generator=generator)}
    graph_module, ctx = make_graph(build_function(operations, extra_outputs), inputs, {})
    expected = run_plain(graph_module, ctx, inputs)
    # The manager lints the rewritten graph (a cycle or a use before definition fails) and re-propagates shapes.
    graph_module = run_pipeline(graph_module, ctx, [PASS])
    result = run_plain(graph_module, ctx, inputs)
    assert len(result) == len(expected)
    for got, want in zip(result, expected, strict=True):
        assert torch.equal(got, want)
    stats = ctx.history[-1]["stats"]
    assert stats["fused_nodes"] >= 2 * stats["groups"]
