"""fuse_gate_up: each gated MLP's gate and up projections become one linear over concatenated weights."""

from __future__ import annotations

import operator

import pytest
import torch

from octavo.errors import PassError
from tests.passes.fusion_harness import (
    DTYPES,
    MODEL_TYPES,
    assert_bitwise_equal,
    compiled,
    outputs,
    passes_before,
    passes_through,
    traced_model,
)
from tests.tiny_models import COMMON

LAYERS = COMMON["num_hidden_layers"]
INTERMEDIATE = COMMON["intermediate_size"]
PASS = "fuse_gate_up"
aten = torch.ops.aten


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_op_counts_before_and_after(model_type):
    before = compiled(model_type, "float32", passes_before(PASS))
    after = compiled(model_type, "float32", passes_through(PASS))
    assert after.count("aten.linear") == before.count("aten.linear") - LAYERS
    assert after.count("aten.split_with_sizes") == before.count("aten.split_with_sizes") + LAYERS
    assert after.count("aten.silu") == LAYERS, "silu and mul stay for fuse_activation"
    assert after.stats(PASS) == {"merged_gate_up": LAYERS}


def test_gate_comes_first_in_the_merged_weight():
    model, _ = traced_model("llama", "float32")
    after = compiled("llama", "float32", passes_through(PASS))
    for layer in range(LAYERS):
        mlp = model.model.layers[layer].mlp
        merged = after.ctx.weights[f"model_layers_{layer}_mlp_gate_up_proj_weight"]
        assert torch.equal(merged, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert f"model_layers_{layer}_mlp_gate_proj_weight" not in after.ctx.weights
    for silu in (node for node in after.graph_module.graph.nodes if node.target is aten.silu.default):
        gate = silu.args[0]
        assert gate.target is operator.getitem and gate.args[1] == 0
        assert gate.args[0].args[1] == [INTERMEDIATE, INTERMEDIATE]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outputs_bitwise_equal_before_and_after(model_type, dtype):
    assert_bitwise_equal(outputs(model_type, dtype, passes_before(PASS)),
                         outputs(model_type, dtype, passes_through(PASS)))


def test_a_second_run_finds_nothing_and_fails():
    with pytest.raises(PassError, match="found no gated MLP"):
        compiled("llama", "float32", (*passes_through(PASS), PASS))
