"""fuse_rms_norm: every decomposed RMSNorm of a traced model becomes one octavo.rms_norm, outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from octavo.errors import PassError
from octavo.passes import run_pipeline
from tests.passes.fusion_harness import (
    DTYPES,
    MODEL_TYPES,
    assert_bitwise_equal,
    compiled,
    make_graph,
    outputs,
    passes_before,
    passes_through,
    run_plain,
)
from tests.tiny_models import COMMON

LAYERS = COMMON["num_hidden_layers"]
PASS = "fuse_rms_norm"


def expected_norms(model_type: str) -> int:
    """Two per layer and the final one; Qwen3 adds a q and a k norm per layer."""
    return 2 * LAYERS + 1 + (2 * LAYERS if model_type == "qwen3" else 0)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_op_counts_before_and_after(model_type):
    before = compiled(model_type, "bfloat16", passes_before(PASS))
    after = compiled(model_type, "bfloat16", passes_through(PASS))
    norms = expected_norms(model_type)
    assert before.count("octavo.rms_norm") == 0
    assert (before.count("aten.mean"), before.count("aten.rsqrt"), before.count("aten.pow")) == (norms,) * 3
    assert after.count("octavo.rms_norm") == norms
    assert (after.count("aten.mean"), after.count("aten.rsqrt"), after.count("aten.pow")) == (0, 0, 0)
    # Each norm removed its two casts (to float32 and back): what is left are the rotary casts only.
    assert before.count("aten._to_copy") - after.count("aten._to_copy") == 2 * norms
    assert after.stats(PASS) == {"rms_norms": norms}
    record = next(record for record in after.ctx.history if record["name"] == PASS)
    assert record["op_histogram"]["octavo.rms_norm"] == norms and record["nodes_after"] < record["nodes_before"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outputs_bitwise_equal_before_and_after(model_type, dtype):
    assert_bitwise_equal(outputs(model_type, dtype, passes_before(PASS)),
                         outputs(model_type, dtype, passes_through(PASS)))


def test_norm_weight_and_eps_are_the_models():
    after = compiled("llama", "float32", passes_through(PASS))
    norms = [node for node in after.graph_module.graph.nodes if node.target is torch.ops.octavo.rms_norm.default]
    weights = [node.args[1].name for node in norms]
    assert weights[0] == "model_layers_0_input_layernorm_weight" and weights[-1] == "model_norm_weight"
    assert {node.args[2] for node in norms} == {1e-6}


def _norm_with_extra_use(x, weight):
    hidden = x.float()
    scale = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5)
    return weight * (hidden * scale).to(x.dtype), scale


def _norm(x, weight):
    hidden = x.float()
    return weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def test_hand_written_norm_is_fused_with_identical_output():
    inputs, weights = {"x": torch.randn(1, 6, 32).bfloat16()}, {"weight": torch.rand(32).bfloat16()}
    graph_module, ctx = make_graph(_norm, inputs, weights)
    expected = run_plain(graph_module, ctx, inputs)
    graph_module = run_pipeline(graph_module, ctx, [PASS])
    assert ctx.history[-1]["stats"] == {"rms_norms": 1}
    assert torch.equal(run_plain(graph_module, ctx, inputs), expected)


def test_a_norm_whose_intermediate_is_used_elsewhere_is_not_fused_and_nothing_matching_is_an_error():
    inputs, weights = {"x": torch.randn(1, 6, 32).bfloat16()}, {"weight": torch.rand(32).bfloat16()}
    graph_module, ctx = make_graph(_norm_with_extra_use, inputs, weights)
    with pytest.raises(PassError, match="fuse_rms_norm found no RMSNorm pattern"):
        run_pipeline(graph_module, ctx, [PASS])


def test_a_second_run_finds_nothing_and_fails():
    with pytest.raises(PassError, match="found no RMSNorm pattern"):
        compiled("llama", "float32", (*passes_through(PASS), PASS))
