"""fuse_qkv: each attention's q, k, v projections become one linear over concatenated weights plus a split."""

from __future__ import annotations

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
PASS = "fuse_qkv"
aten = torch.ops.aten


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_op_counts_before_and_after(model_type):
    before = compiled(model_type, "float32", passes_before(PASS))
    after = compiled(model_type, "float32", passes_through(PASS))
    assert before.count("aten.linear") == 7 * LAYERS + 1  # q, k, v, o, gate, up, down; lm_head
    assert after.count("aten.linear") == 5 * LAYERS + 1
    assert (before.count("aten.split_with_sizes"), after.count("aten.split_with_sizes")) == (0, LAYERS)
    assert after.stats(PASS) == {"merged_qkv": LAYERS, "merged_linears": 3 * LAYERS}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_weights_are_concatenated_and_the_old_ones_removed(model_type):
    model, _ = traced_model(model_type, "float32")
    after = compiled(model_type, "float32", passes_through(PASS))
    weights = after.ctx.weights
    has_bias = model_type == "qwen2"
    for layer in range(LAYERS):
        attention = model.model.layers[layer].self_attn
        prefix = f"model_layers_{layer}_self_attn_"
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        assert torch.equal(weights[prefix + "qkv_proj_weight"], torch.cat([p.weight for p in projections]))
        if has_bias:
            assert torch.equal(weights[prefix + "qkv_proj_bias"], torch.cat([p.bias for p in projections]))
        for name in ("q_proj", "k_proj", "v_proj"):
            assert f"{prefix}{name}_weight" not in weights and f"{prefix}{name}_bias" not in weights
    placeholders = {node.name for node in after.graph_module.graph.nodes if node.op == "placeholder"}
    assert set(weights) <= placeholders
    merged = [node for node in after.graph_module.graph.nodes
              if node.target is aten.linear.default and "qkv_proj" in node.args[1].name]
    assert len(merged) == LAYERS and all((len(node.args) == 3) == has_bias for node in merged)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outputs_bitwise_equal_before_and_after(model_type, dtype):
    assert_bitwise_equal(outputs(model_type, dtype, passes_before(PASS)),
                         outputs(model_type, dtype, passes_through(PASS)))


def test_without_paged_attention_it_is_an_error():
    with pytest.raises(PassError, match=r"found no octavo\.paged_attention"):
        compiled("llama", "float32", ("canonicalize", PASS))


def test_a_second_run_finds_nothing_to_merge_and_fails():
    with pytest.raises(PassError, match="could not merge the projections"):
        compiled("llama", "float32", (*passes_through(PASS), PASS))
