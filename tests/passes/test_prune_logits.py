"""prune_logits: the lm_head runs only on the rows in logits_indices, which the output then holds in order."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from octavo.config import CompileConfig
from octavo.errors import PassError
from octavo.frontend.architectures import architecture_for
from octavo.frontend.trace import TracedModel, trace_module
from octavo.ir.graph import count_ops, format_value
from octavo.passes import PassContext, run_pipeline
from octavo.passes.prune_logits import prune_logits
from tests.tiny_models import VOCAB_SIZE, make_tiny_model

aten = torch.ops.aten
NUM_TOKENS = 13


def clone_graph(graph_module: GraphModule) -> GraphModule:
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    return GraphModule(torch.nn.Module(), graph)


def make_context(traced: TracedModel, model) -> PassContext:
    return PassContext(config=CompileConfig(), weights=dict(traced.weights), model_config=model.config,
                       architecture=architecture_for(model.config), fake_mode=traced.fake_mode,
                       symbols={"T": traced.num_tokens})


def run_graph(graph_module: GraphModule, weights: dict[str, torch.Tensor], inputs: dict) -> torch.Tensor:
    arguments = [weights[node.name] if node.name in weights else inputs[node.name]
                 for node in graph_module.graph.nodes if node.op == "placeholder"]
    with torch.no_grad():
        return graph_module(*arguments)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_and_trace(request):
    """llama (separate lm_head weight) and qwen3 (lm_head tied to the embedding)."""
    model = make_tiny_model(request.param)
    return model, trace_module(model)


@pytest.fixture(scope="module")
def pruned(model_and_trace):
    model, traced = model_and_trace
    ctx = make_context(traced, model)
    graph_module = run_pipeline(clone_graph(traced.graph_module), ctx, ["canonicalize", "prune_logits"])
    return ctx, graph_module


@pytest.fixture(scope="module")
def token_inputs():
    generator = torch.Generator().manual_seed(7)
    return {"input_ids": torch.randint(0, VOCAB_SIZE, (NUM_TOKENS,), generator=generator),
            "positions": torch.arange(NUM_TOKENS)}


@pytest.mark.parametrize("indices", [[NUM_TOKENS - 1], [0, 5, 12], [12, 3, 3, 0], list(range(NUM_TOKENS))],
                         ids=["last", "ascending", "unordered-repeated", "all"])
def test_rows_equal_unpruned_logits_at_indices(model_and_trace, pruned, token_inputs, indices):
    _, traced = model_and_trace
    ctx, graph_module = pruned
    full = run_graph(traced.graph_module, traced.weights, token_inputs)
    assert full.shape == (NUM_TOKENS, VOCAB_SIZE)
    rows = run_graph(graph_module, ctx.weights, {**token_inputs, "logits_indices": torch.tensor(indices)})
    assert rows.shape == (len(indices), VOCAB_SIZE)
    torch.testing.assert_close(rows, full[indices], atol=1e-5, rtol=1e-5)


def test_output_is_n_by_vocab_and_only_the_lm_head_moves(model_and_trace, pruned):
    _, traced = model_and_trace
    ctx, graph_module = pruned
    output = graph_module.graph.output_node().args[0]
    assert format_value(output.meta["val"], ctx.symbol_names()) == f"f32[N, {VOCAB_SIZE}]"
    assert ctx.runtime_inputs["logits_indices"] == {"shape": ["N"], "dtype": "int64", "role": "logits_indices"}
    (select,) = [node for node in graph_module.graph.nodes if node.target is aten.index_select.default]
    assert list(select.users) == [graph_module.graph.find_nodes(op="call_function", target=aten.linear.default)[-1]]
    assert ctx.history[-1]["stats"]["pruned_lm_head"] == select.next.name
    linears = count_ops(traced.graph_module, "aten.linear")
    assert count_ops(graph_module, "aten.linear") == linears  # nothing else is pruned or duplicated


def bare_context() -> PassContext:
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    return PassContext(config=CompileConfig(), weights={}, model_config=None, architecture=None,
                       fake_mode=fake_mode, symbols={})


def graph_calling(target, *shapes: tuple[int, ...]) -> GraphModule:
    """A graph of one call `target(*inputs)` on float inputs of these shapes, meta["val"] filled."""
    graph, fake_mode = Graph(), FakeTensorMode()
    inputs = []
    for index, shape in enumerate(shapes):
        node = graph.placeholder(f"input_{index}")
        with fake_mode:
            node.meta["val"] = torch.empty(shape)
        inputs.append(node)
    call = graph.call_function(target, tuple(inputs))
    with fake_mode:
        call.meta["val"] = target(*[node.meta["val"] for node in inputs])
    graph.output(call)
    return GraphModule(torch.nn.Module(), graph)


def test_no_lm_head_is_an_error():
    with pytest.raises(PassError, match="no lm_head linear"):
        prune_logits(graph_calling(aten.mul.Tensor, (1, 4, 8), (1, 4, 8)), bare_context())


def test_lm_head_on_unbatched_hidden_is_an_error():
    with pytest.raises(PassError, match=r"shape \(4, 8\), expected \[1, T, H\]"):
        prune_logits(graph_calling(aten.linear.default, (4, 8), (16, 8)), bare_context())


def test_lm_head_on_batched_hidden_is_accepted():
    """The positive twin of the two errors above: the same one-op graph with a [1, T, H] input is pruned."""
    ctx = bare_context()
    graph_module = prune_logits(graph_calling(aten.linear.default, (1, 4, 8), (16, 8)), ctx)
    assert count_ops(graph_module, "aten.index_select") == 1
