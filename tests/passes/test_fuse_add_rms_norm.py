"""fuse_add_rms_norm: residual add + the following norm -> octavo.fused_add_rms_norm, across layer boundaries."""

from __future__ import annotations

import itertools
import operator

import pytest
import torch

from octavo.errors import PassError
from octavo.passes import run_pipeline
from tests.passes.fusion_harness import (
    BASE_PASSES,
    DTYPES,
    MODEL_TYPES,
    assert_bitwise_equal,
    compiled,
    make_graph,
    outputs,
    passes_before,
    passes_through,
)
from tests.tiny_models import COMMON

LAYERS = COMMON["num_hidden_layers"]
PASS = "fuse_add_rms_norm"
octavo = torch.ops.octavo


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_op_counts_before_and_after(model_type):
    before = compiled(model_type, "float32", passes_before(PASS))
    after = compiled(model_type, "float32", passes_through(PASS))
    per_head_norms = 2 * LAYERS if model_type == "qwen3" else 0
    assert before.count("octavo.rms_norm") == 2 * LAYERS + 1 + per_head_norms
    assert after.count("octavo.fused_add_rms_norm") == 2 * LAYERS
    # Left as rms_norm: the very first norm (it reads the embedding) and Qwen3's q/k norms.
    assert after.count("octavo.rms_norm") == 1 + per_head_norms
    assert before.count("aten.add.Tensor") - after.count("aten.add.Tensor") == 2 * LAYERS
    assert after.stats(PASS) == {"fused_add_rms_norms": 2 * LAYERS, "rms_norms_left": 1 + per_head_norms}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outputs_bitwise_equal_before_and_after(model_type, dtype):
    assert_bitwise_equal(outputs(model_type, dtype, passes_before(PASS)),
                         outputs(model_type, dtype, passes_through(PASS)))


def test_residual_stream_runs_through_the_fused_ops_across_layers():
    graph = compiled("llama", "float32", passes_through(PASS)).graph_module.graph
    fused = [node for node in graph.nodes if node.target is octavo.fused_add_rms_norm.default]
    first_norm = next(node for node in graph.nodes if node.target is octavo.rms_norm.default)
    assert first_norm.args[0].target is torch.ops.aten.embedding.default
    assert fused[0].args[1] is first_norm.args[0], "layer 0's post-attention norm adds onto the embedding"
    for previous, current in itertools.pairwise(fused):
        residual = current.args[1]
        assert residual.target is operator.getitem and residual.args == (previous, 1)
    weights = [node.args[2].name for node in fused]
    assert weights == ["model_layers_0_post_attention_layernorm_weight", "model_layers_1_input_layernorm_weight",
                       "model_layers_1_post_attention_layernorm_weight", "model_norm_weight"]
    # The final norm, fused with the last residual add, feeds the lm_head rows.
    lm_rows = next(node for node in graph.nodes if node.target is torch.ops.aten.index_select.default)
    assert lm_rows.args[0].args == (fused[-1], 0)


def test_skipped_when_fuse_rms_norm_is_disabled():
    disabled = ("fuse_rms_norm",)
    result = compiled("llama", "float32", (*BASE_PASSES, "fuse_rms_norm", PASS), disabled)
    assert result.stats(PASS) == {"skipped": "fuse_rms_norm is disabled"}
    assert result.count("octavo.fused_add_rms_norm") == 0


def test_without_rms_norm_nodes_it_is_an_error():
    with pytest.raises(PassError, match=r"found no octavo\.rms_norm node"):
        compiled("llama", "float32", (*BASE_PASSES, PASS))


def test_norms_with_no_add_before_them_are_an_error():
    with pytest.raises(PassError, match="none reads a residual add"):
        compiled("llama", "float32", (*passes_through(PASS), PASS))


def test_a_broadcasting_add_is_not_fused():
    def function(x, bias, weight):
        return torch.ops.octavo.rms_norm(x + bias, weight, 1e-6)

    inputs = {"x": torch.randn(1, 4, 16), "bias": torch.randn(16)}
    graph_module, ctx = make_graph(function, inputs, {"weight": torch.rand(16)})
    with pytest.raises(PassError, match="none reads a residual add"):
        run_pipeline(graph_module, ctx, [PASS])
