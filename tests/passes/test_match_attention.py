"""match_attention: every SDPA (with its repeat_kv and mask) becomes one octavo.paged_attention.

Graphs are traced from tiny random-weight models; the rewritten graph is run
with a paged KV cache and must give the traced graph's logits (which equal HF's,
see tests/frontend/test_trace.py), both for a whole sequence at once and for a
prefill followed by decode steps over the cache it filled.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx import Graph, GraphModule
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from octavo.config import CompileConfig
from octavo.errors import PassError
from octavo.frontend.architectures import architecture_for
from octavo.frontend.trace import TracedModel, trace_module
from octavo.ir.graph import count_ops, find_nodes
from octavo.passes import PassContext, run_pipeline
from tests.tiny_models import COMMON, make_tiny_model

aten = torch.ops.aten
paged_attention = torch.ops.octavo.paged_attention.default
BLOCK_SIZE = 16
NUM_LAYERS = COMMON["num_hidden_layers"]


def clone_graph(graph_module: GraphModule) -> GraphModule:
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    return GraphModule(torch.nn.Module(), graph)


def make_context(traced: TracedModel, model, **config) -> PassContext:
    return PassContext(config=CompileConfig(**config), weights=dict(traced.weights), model_config=model.config,
                       architecture=architecture_for(model.config), fake_mode=traced.fake_mode,
                       symbols={"T": traced.num_tokens})


def run_graph(graph_module: GraphModule, weights: dict[str, torch.Tensor], inputs: dict) -> torch.Tensor:
    arguments = [weights[node.name] if node.name in weights else inputs[node.name]
                 for node in graph_module.graph.nodes if node.op == "placeholder"]
    with torch.no_grad():
        return graph_module(*arguments)


class Matched:
    """A traced model rewritten by a pipeline, with the pieces the tests read."""

    def __init__(self, model, traced: TracedModel, passes: list[str]):
        self.model, self.traced = model, traced
        self.before = clone_graph(traced.graph_module)
        self.ctx = make_context(traced, model)
        self.graph_module = run_pipeline(clone_graph(traced.graph_module), self.ctx, passes)
        self.stats = self.ctx.history[-1]["stats"]


def sliding_qwen2(num_kv_heads: int):
    """Qwen2 whose second layer (only) uses a 5-token window; GQA ratio 4 / num_kv_heads."""
    config = Qwen2Config(**{**COMMON, "num_key_value_heads": num_kv_heads}, use_sliding_window=True,
                         sliding_window=5, max_window_layers=1, tie_word_embeddings=True)
    return _random_model(config)


def mistral_with_layer_types():
    """A Mistral config that carries layer_types (as some checkpoints do); MistralModel windows every layer."""
    config = MistralConfig(**COMMON, sliding_window=5, layer_types=["full_attention", "sliding_attention"],
                           tie_word_embeddings=False)
    return _random_model(config)


def _random_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.08) if "norm" not in name else parameter.uniform_(0.8, 1.2)
    return model.eval()


@pytest.fixture(scope="module")
def llama():
    model = make_tiny_model("llama")
    return model, trace_module(model)


@pytest.fixture(scope="module")
def matched_llama(llama) -> Matched:
    return Matched(*llama, ["canonicalize", "match_attention"])


@pytest.fixture(scope="module")
def matched_qwen2_no_gqa() -> Matched:
    model = sliding_qwen2(num_kv_heads=COMMON["num_attention_heads"])
    return Matched(model, trace_module(model), ["canonicalize", "match_attention"])


@pytest.fixture(scope="module")
def matched_mistral_layer_types() -> Matched:
    model = mistral_with_layer_types()
    return Matched(model, trace_module(model), ["canonicalize", "match_attention"])


def paged_inputs(matched: Matched, token_ids: torch.Tensor, start: int, cache: dict, block_table: list[int]) -> dict:
    """Inputs for one sequence whose first `start` tokens are cached, running tokens start..len-1."""
    positions = torch.arange(start, len(token_ids))
    blocks = torch.tensor(block_table)
    return {
        "input_ids": token_ids[start:], "positions": positions,
        "slot_mapping": blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        "block_tables": torch.tensor([block_table], dtype=torch.int32),
        "seq_lens": torch.tensor([len(token_ids)], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, len(token_ids) - start], dtype=torch.int32),
        **cache,
    }


def fresh_cache(matched: Matched, num_blocks: int = 8) -> dict:
    """Per-layer pools as the runtime allocates them (uninitialized: here NaN, so any stray read shows)."""
    layout = matched.ctx.kv_layout
    shape = (num_blocks, layout["block_size"], layout["num_kv_heads"], layout["head_dim"])
    return {name: torch.full(shape, float("nan")) for pair in layout["cache_inputs"] for name in pair}


def traced_logits(matched: Matched, token_ids: torch.Tensor) -> torch.Tensor:
    inputs = {"input_ids": token_ids, "positions": torch.arange(len(token_ids))}
    return run_graph(matched.traced.graph_module, matched.traced.weights, inputs)


def assert_matches_traced_graph(matched: Matched, num_tokens: int, prefill: int) -> None:
    """Whole sequence in one step, and `prefill` tokens then one decode step per remaining token."""
    token_ids = torch.randint(0, 49152, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens))
    expected = traced_logits(matched, token_ids)
    block_table = [5, 2, 7]  # not contiguous, not ascending
    whole = run_graph(matched.graph_module, matched.ctx.weights,
                      paged_inputs(matched, token_ids, 0, fresh_cache(matched), block_table))
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    cache = fresh_cache(matched)
    rows = [run_graph(matched.graph_module, matched.ctx.weights,
                      paged_inputs(matched, token_ids[:prefill], 0, cache, block_table))]
    for length in range(prefill + 1, num_tokens + 1):
        rows.append(run_graph(matched.graph_module, matched.ctx.weights,
                              paged_inputs(matched, token_ids[:length], length - 1, cache, block_table)))
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------------------- structure


def test_op_counts_before_and_after(matched_llama):
    before, after = matched_llama.before, matched_llama.graph_module
    assert count_ops(before, "aten.scaled_dot_product_attention") == NUM_LAYERS
    assert count_ops(after, "aten.scaled_dot_product_attention") == 0
    assert count_ops(after, "octavo.paged_attention") == NUM_LAYERS
    assert matched_llama.stats["replaced_sdpa"] == NUM_LAYERS


def test_repeat_kv_and_mask_are_gone(matched_llama):
    before, after = matched_llama.before, matched_llama.graph_module
    # repeat_kv is expand + clone + _unsafe_view of k and v per layer; the mask compares positions.
    assert count_ops(before, "aten.clone") == 2 * NUM_LAYERS
    assert count_ops(before, "aten._unsafe_view") == 2 * NUM_LAYERS
    assert matched_llama.stats["removed_repeat_kv"] == NUM_LAYERS
    for op in ("aten.expand", "aten.clone", "aten._unsafe_view", "aten.le", "aten.__and__", "aten.cumsum"):
        assert count_ops(after, op) == 0, op


def test_cache_stores_kv_heads_only(matched_llama):
    config = matched_llama.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    placeholders = {node.name: node for node in matched_llama.graph_module.graph.nodes if node.op == "placeholder"}
    for layer in range(NUM_LAYERS):
        for name in (f"key_cache_{layer}", f"value_cache_{layer}"):
            shape = placeholders[name].meta["val"].shape
            assert isinstance(shape[0], torch.SymInt)  # num_blocks is decided by the runtime
            assert tuple(shape[1:]) == (BLOCK_SIZE, config.num_key_value_heads, head_dim)
    for node in find_nodes(matched_llama.graph_module, paged_attention):
        query, key, value = (argument.meta["val"] for argument in node.args[:3])
        assert tuple(query.shape[1:]) == (config.num_attention_heads, head_dim)
        assert tuple(key.shape[1:]) == tuple(value.shape[1:]) == (config.num_key_value_heads, head_dim)
        assert node.args[9] == pytest.approx(1 / math.sqrt(head_dim))
    layout = matched_llama.ctx.kv_layout
    assert layout == {
        "num_layers": NUM_LAYERS, "num_kv_heads": config.num_key_value_heads,
        "num_heads": config.num_attention_heads, "head_dim": head_dim, "block_size": BLOCK_SIZE,
        "cache_dtype": "float32", "sliding_windows": [-1] * NUM_LAYERS,
        "cache_inputs": [[f"key_cache_{layer}", f"value_cache_{layer}"] for layer in range(NUM_LAYERS)],
    }


def test_runtime_inputs_are_declared(matched_llama):
    names = [node.name for node in matched_llama.graph_module.graph.nodes if node.op == "placeholder"]
    runtime = [name for name in names if name not in matched_llama.ctx.weights]
    assert runtime == ["input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                       "key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"]
    declared = matched_llama.ctx.runtime_inputs
    assert declared["slot_mapping"] == {"shape": ["T"], "dtype": "int64", "role": "attention_metadata"}
    assert declared["block_tables"]["dtype"] == "int32"
    assert declared["query_start_loc"]["shape"] == ["B+1"]


def test_no_sdpa_is_an_error(matched_llama):
    ctx = make_context(matched_llama.traced, matched_llama.model)
    with pytest.raises(PassError, match="found no scaled_dot_product_attention"):
        run_pipeline(clone_graph(matched_llama.graph_module), ctx, ["match_attention"])


def test_gqa_ratio_one_has_no_repeat(matched_qwen2_no_gqa):
    heads = COMMON["num_attention_heads"]
    assert matched_qwen2_no_gqa.stats["removed_repeat_kv"] == 0
    assert count_ops(matched_qwen2_no_gqa.before, "aten._unsafe_view") == 0  # HF skips repeat_kv for ratio 1
    assert matched_qwen2_no_gqa.ctx.kv_layout["num_kv_heads"] == heads
    assert count_ops(matched_qwen2_no_gqa.graph_module, "octavo.paged_attention") == NUM_LAYERS


def test_per_layer_sliding_windows_from_config(matched_qwen2_no_gqa, matched_mistral_layer_types):
    qwen2_windows = [node.args[10] for node in find_nodes(matched_qwen2_no_gqa.graph_module, paged_attention)]
    assert qwen2_windows == [-1, 5]  # layers from max_window_layers=1 on slide
    assert matched_qwen2_no_gqa.ctx.kv_layout["sliding_windows"] == [-1, 5]
    mistral_windows = [node.args[10] for node in find_nodes(matched_mistral_layer_types.graph_module,
                                                            paged_attention)]
    assert mistral_windows == [5, 5]  # MistralModel ignores layer_types


# ------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("prefill", [1, 11])
def test_llama_matches_traced_graph(matched_llama, prefill):
    assert_matches_traced_graph(matched_llama, num_tokens=20, prefill=prefill)


def test_sliding_window_qwen2_matches_traced_graph(matched_qwen2_no_gqa):
    assert_matches_traced_graph(matched_qwen2_no_gqa, num_tokens=19, prefill=7)


def test_mistral_with_layer_types_matches_traced_graph(matched_mistral_layer_types):
    assert_matches_traced_graph(matched_mistral_layer_types, num_tokens=19, prefill=7)


def test_without_canonicalize_kv_heads_are_still_unrepeated(llama):
    """Disabling canonicalize leaves full slices inside repeat_kv; the cache must still hold kv heads only."""
    matched = Matched(*llama, ["match_attention"])
    assert matched.stats["removed_repeat_kv"] == NUM_LAYERS
    assert matched.ctx.kv_layout["num_kv_heads"] == llama[0].config.num_key_value_heads
    assert_matches_traced_graph(matched, num_tokens=18, prefill=17)
