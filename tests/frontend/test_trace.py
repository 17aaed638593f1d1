"""Tracing: the exported flat-token graph computes HF's logits, with weights as named placeholders."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from octavo.frontend.architectures import sliding_windows
from octavo.frontend.sources import load_model
from octavo.frontend.trace import TOKEN_INPUTS, TracedModel, trace, trace_module
from tests.tiny_models import COMMON, TINY_WINDOW, VOCAB_SIZE, make_tiny_model, tiny_config

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama():
    model = make_tiny_model("llama")
    return model, trace_module(model)


@pytest.fixture(scope="module")
def qwen3():
    model = make_tiny_model("qwen3")
    return model, trace_module(model)


@pytest.fixture(scope="module")
def qwen2_from_directory(tiny_model_dir):
    """Traced through load_model + trace, as `octavo compile` does; qwen2 ties lm_head to the embedding."""
    directory = tiny_model_dir("qwen2")
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return reference, trace(load_model(directory), "float32")


def run_traced(traced: TracedModel, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inputs = {"input_ids": input_ids, "positions": positions}
    arguments = [traced.weights[node.name] if node.name in traced.weights else inputs[node.name]
                 for node in traced.graph_module.graph.nodes if node.op == "placeholder"]
    with torch.no_grad():
        return traced.graph_module(*arguments)


def module_tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


# ------------------------------------------------------------------------------------------ placeholders


def test_placeholders_are_weight_names_then_token_inputs(llama):
    model, traced = llama
    placeholders = [node.name for node in traced.graph_module.graph.nodes if node.op == "placeholder"]
    assert placeholders == [*traced.weights, *TOKEN_INPUTS]
    assert set(traced.weight_sources) == set(traced.weights)
    tensors = module_tensors(model)
    for name, source in traced.weight_sources.items():
        assert name == re.sub(r"\W", "_", source)
        assert torch.equal(traced.weights[name], tensors[source]), name
    assert "model_layers_1_self_attn_k_proj_weight" in traced.weights
    assert set(dict(model.named_parameters())) <= set(traced.weight_sources.values())  # every parameter


def test_token_inputs_have_a_symbolic_length(llama):
    _, traced = llama
    nodes = {node.name: node for node in traced.graph_module.graph.nodes if node.op == "placeholder"}
    for name in TOKEN_INPUTS:
        value = nodes[name].meta["val"]
        assert value.dtype == torch.int64 and value.shape == (traced.num_tokens,)
        assert isinstance(traced.num_tokens, torch.SymInt)
    output = traced.graph_module.graph.output_node().args[0].meta["val"]
    assert output.shape == (traced.num_tokens, VOCAB_SIZE)


def test_tied_embeddings_are_one_weight(qwen2_from_directory):
    model, traced = qwen2_from_directory
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the HF model ties them
    assert "lm_head.weight" not in traced.weight_sources.values()
    assert sum(source.endswith("embed_tokens.weight") for source in traced.weight_sources.values()) == 1
    lm_head = [node for node in traced.graph_module.graph.nodes if node.target is aten.linear.default][-1]
    embedding = next(node for node in traced.graph_module.graph.nodes if node.target is aten.embedding.default)
    assert lm_head.args[1] is embedding.args[0]
    assert lm_head.args[1].name == "model_embed_tokens_weight"


def test_untied_lm_head_keeps_its_own_weight(llama):
    _, traced = llama
    assert traced.weight_sources["lm_head_weight"] == "lm_head.weight"
    assert traced.weight_sources["model_embed_tokens_weight"] == "model.embed_tokens.weight"


# ---------------------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("fixture", ["llama", "qwen3", "qwen2_from_directory"])
@pytest.mark.parametrize(("num_tokens", "first_position"), [(1, 0), (1, 37), (2, 0), (23, 0), (9, 100)])
def test_traced_graph_equals_hf_logits(request, fixture, num_tokens, first_position):
    model, traced = request.getfixturevalue(fixture)
    generator = torch.Generator().manual_seed(num_tokens + first_position)
    input_ids = torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=generator)
    positions = torch.arange(first_position, first_position + num_tokens)
    with torch.no_grad():
        expected = model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False).logits[0]
    logits = run_traced(traced, input_ids, positions)
    assert logits.shape == (num_tokens, VOCAB_SIZE)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- sliding windows


def test_sliding_windows_of_the_tiny_models():
    assert sliding_windows(tiny_config("llama")) == [-1, -1]
    assert sliding_windows(tiny_config("mistral")) == [TINY_WINDOW, TINY_WINDOW]
    assert sliding_windows(tiny_config("qwen2")) == [-1, -1]  # use_sliding_window defaults to False
    assert sliding_windows(tiny_config("qwen3")) == [-1, -1]


def test_mistral_windows_every_layer_or_none():
    assert sliding_windows(MistralConfig(**COMMON, sliding_window=None)) == [-1, -1]
    # MistralModel builds one sliding mask for all layers and ignores layer_types, even when present.
    carried = MistralConfig(**COMMON, sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    assert sliding_windows(carried) == [8, 8]


def test_qwen_layer_types_choose_per_layer():
    three_layers = {**COMMON, "num_hidden_layers": 3}
    # Qwen2/Qwen3 slide on layers >= max_window_layers, only with use_sliding_window.
    assert sliding_windows(Qwen2Config(**three_layers, use_sliding_window=True, sliding_window=6,
                                       max_window_layers=1)) == [-1, 6, 6]
    assert sliding_windows(Qwen2Config(**three_layers, use_sliding_window=False, sliding_window=6,
                                       max_window_layers=1)) == [-1, -1, -1]
    explicit = Qwen3Config(**three_layers, use_sliding_window=True, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert sliding_windows(explicit) == [4, -1, 4]


def test_llama_has_no_window_whatever_the_config_says():
    config = LlamaConfig(**COMMON)
    config.sliding_window = 8  # not an attribute LlamaModel reads
    assert sliding_windows(config) == [-1, -1]
