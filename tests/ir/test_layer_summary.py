"""layer_summary: the ops of every decoder layer in order, grouped when layers are equal."""

from __future__ import annotations

import pytest
import torch

from octavo.ir.layer_summary import layer_summary
from octavo.runtime.loader import load_artifact

aten = torch.ops.aten
FUSED_LAYER_TAIL = ["aten.linear(self_attn_o_proj)", "octavo.fused_add_rms_norm(post_attention_layernorm)",
                    "aten.linear(mlp_gate_up_proj)", "octavo.silu_and_mul", "aten.linear(mlp_down_proj)"]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_tiny_models_show_one_group_per_distinct_layer(tiny_artifact, model_type):
    groups = layer_summary(load_artifact(tiny_artifact(model_type)).graph_module)
    names = [group["name"] for group in groups]
    assert names == ["embedding", "layer 0", "layer 1", "final"]
    first, second = groups[1]["ops"], groups[2]["ops"]
    assert first[0] == "octavo.rms_norm(input_layernorm)"
    assert second[0] == "octavo.fused_add_rms_norm(input_layernorm)"
    assert first[1:] == second[1:], "apart from the first norm, every layer runs the same ops"
    assert first[-5:] == FUSED_LAYER_TAIL
    assert second.count("octavo.paged_attention") == 1 and second.count("octavo.rotary_embedding") == 1
    if model_type == "qwen3":  # q/k norms named by their own weights, before the rotary embedding
        assert second.index("octavo.rms_norm(self_attn_q_norm)") < second.index("octavo.rotary_embedding")
    assert groups[-1]["ops"][0] == "octavo.fused_add_rms_norm(norm)"


def test_equal_layers_are_grouped_with_their_range_and_ops_follow_their_weights():
    """Hand-made graph: embedding, 4 layers (layer 2 adds a relu), final norm weight outside the layers."""
    graph = torch.fx.Graph()
    hidden = graph.placeholder("input")
    hidden = graph.call_function(aten.mul.Tensor, (hidden, graph.placeholder("model_embed_tokens_weight")))
    for layer in range(4):
        weight = graph.placeholder(f"model_layers_{layer}_mlp_up_proj_weight")
        hidden = graph.call_function(aten.linear.default, (hidden, weight))
        hidden = graph.call_function(aten.view.default, (hidden, [-1]))  # layout: left out
        hidden = graph.call_function(aten.silu.default, (hidden,))  # no weight: the layer of the op before
        if layer == 2:
            hidden = graph.call_function(aten.relu.default, (hidden,))
    hidden = graph.call_function(aten.mul.Tensor, (hidden, graph.placeholder("model_norm_weight")))
    hidden = graph.call_function(aten.neg.default, (hidden,))
    graph.output(hidden)
    groups = layer_summary(torch.fx.GraphModule(torch.nn.Module(), graph))
    layer_ops = ["aten.linear(mlp_up_proj)", "aten.silu"]
    assert groups == [
        {"name": "embedding", "ops": ["aten.mul.Tensor(embed_tokens)"]},
        {"name": "layers 0-1", "ops": layer_ops},
        {"name": "layer 2", "ops": [*layer_ops, "aten.relu"]},
        {"name": "layer 3", "ops": layer_ops},
        {"name": "final", "ops": ["aten.mul.Tensor(norm)", "aten.neg"]},
    ]
