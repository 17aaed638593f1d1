"""canonicalize on a traced tiny llama, with no-op and real ops spliced into its live path.

Every removal is checked by name and count, and the graph computes bit-identical
logits before and after the pass.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule, Node

from octavo.config import CompileConfig
from octavo.frontend.architectures import architecture_for
from octavo.frontend.trace import TracedModel, trace_module
from octavo.ir.graph import count_ops
from octavo.passes.canonicalize import canonicalize
from octavo.passes.context import PassContext
from tests.tiny_models import COMMON, make_tiny_model

aten = torch.ops.aten
INT64_MAX = 2**63 - 1
NUM_TOKENS = 9
NUM_LAYERS = COMMON["num_hidden_layers"]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def traced(model) -> TracedModel:
    return trace_module(model)


def clone_graph(graph_module: GraphModule) -> GraphModule:
    """A new GraphModule over a copy of the graph (node names and meta kept), so passes can mutate it."""
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    return GraphModule(torch.nn.Module(), graph)


def make_context(traced: TracedModel, model) -> PassContext:
    return PassContext(config=CompileConfig(), weights=dict(traced.weights), model_config=model.config,
                       architecture=architecture_for(model.config), fake_mode=traced.fake_mode,
                       symbols={"T": traced.num_tokens})


def run_graph(graph_module: GraphModule, weights: dict[str, torch.Tensor], **inputs: torch.Tensor) -> torch.Tensor:
    arguments = [weights[node.name] if node.name in weights else inputs[node.name]
                 for node in graph_module.graph.nodes if node.op == "placeholder"]
    with torch.no_grad():
        return graph_module(*arguments)


@pytest.fixture(scope="module")
def token_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, 49152, (NUM_TOKENS,), generator=generator),
            "positions": torch.arange(NUM_TOKENS)}


def splice(graph_module: GraphModule, fake_mode, anchor: Node, target, *args, **kwargs) -> Node:
    """Insert `target(anchor, *args)` right after `anchor`, reroute anchor's users to it, annotate meta["val"]."""
    graph = graph_module.graph
    users = list(anchor.users)
    with graph.inserting_after(anchor):
        node = graph.call_function(target, (anchor, *args), kwargs)
    for user in users:
        user.replace_input_with(anchor, node)
    meta_args = [arg.meta["val"] if isinstance(arg, Node) else arg for arg in (anchor, *args)]
    with fake_mode:
        node.meta["val"] = target(*meta_args, **kwargs)
    return node


def lm_head(graph_module: GraphModule) -> Node:
    return [node for node in graph_module.graph.nodes if node.target is aten.linear.default][-1]


def full_slices(graph_module: GraphModule) -> list[str]:
    """Names of slices that keep their whole dimension, read off the arguments (start 0, end INT64_MAX)."""
    return [node.name for node in graph_module.graph.nodes
            if node.target is aten.slice.Tensor and node.args[2:] in ((0, INT64_MAX), (0, INT64_MAX, 1))]


def names(graph_module: GraphModule) -> set[str]:
    return {node.name for node in graph_module.graph.nodes}


@pytest.fixture(scope="module")
def spliced(traced, model):
    """The traced graph with no-op and real ops spliced in before and after the lm_head, then canonicalized."""
    graph_module = clone_graph(traced.graph_module)
    fake_mode = traced.fake_mode
    head = lm_head(graph_module)
    hidden = head.args[0]
    seq_dim = next(node for node in graph_module.graph.nodes if node.target is aten.sym_size.int)
    noops = [splice(graph_module, fake_mode, hidden, aten.alias.default)]
    noops.append(splice(graph_module, fake_mode, noops[-1], aten.detach.default))
    noops.append(splice(graph_module, fake_mode, noops[-1], aten._to_copy.default, dtype=torch.float32))
    noops.append(splice(graph_module, fake_mode, noops[-1], aten.slice.Tensor, 2, 0, 1000))  # end > size 64
    noops.append(splice(graph_module, fake_mode, noops[-1], aten.slice.Tensor, 1, 0, seq_dim))  # end = T
    noop_expand = splice(graph_module, fake_mode, noops[-1], aten.expand.default, [-1] * hidden.meta["val"].dim())
    noops.append(noop_expand)
    widen = splice(graph_module, fake_mode, noops[-1], aten._to_copy.default, dtype=torch.float64)
    narrow = splice(graph_module, fake_mode, widen, aten._to_copy.default, dtype=torch.float32)
    noops.append(splice(graph_module, fake_mode, narrow, aten.slice.Tensor, 2, 0, 64, 1))  # end = size 64
    noops.append(splice(graph_module, fake_mode, head, aten.slice.Tensor, 2, 0, 49152))  # whole vocab, end > 256
    with graph_module.graph.inserting_before(graph_module.graph.output_node()):
        dead = graph_module.graph.call_function(aten.neg.default, (head,))
        dead_too = graph_module.graph.call_function(aten.mul.Tensor, (dead, 2.0))
    graph_module.recompile()
    before = clone_graph(graph_module)
    ctx = make_context(traced, model)
    weights_before = dict(ctx.weights)
    after = canonicalize(graph_module, ctx)
    after.recompile()
    return {"before": before, "after": after, "ctx": ctx, "weights_before": weights_before,
            "noops": [node.name for node in noops], "kept": [widen.name, narrow.name],
            "dead": [dead.name, dead_too.name], "noop_expand": noop_expand.name}


def test_spliced_no_ops_are_removed(spliced):
    assert set(spliced["noops"]) & names(spliced["after"]) == set()
    stats = spliced["ctx"].stats
    assert stats["aliases"] == 2
    assert stats["noop_casts"] == 1


def test_full_slices_are_removed_partial_ones_kept(spliced, traced):
    traced_full = full_slices(traced.graph_module)
    # The causal mask's and repeat_kv's [:, :, None] indexing (and, in some transformers releases, the rotary
    # table's [None, :, None]): at least the k and v of every layer.
    assert len(traced_full) >= 2 * NUM_LAYERS
    assert full_slices(spliced["after"]) == []
    assert spliced["ctx"].stats["noop_slices"] == len(traced_full) + 4  # and the four spliced ones
    # Real slices stay: rotate_half's x[..., :8] and x[..., 8:] of q and k in both layers, and the
    # mask's positions[:, :1].
    partial = [node.name for node in traced.graph_module.graph.nodes
               if node.target is aten.slice.Tensor and node.name not in traced_full]
    assert len(partial) == 4 * NUM_LAYERS + 1
    assert set(partial) <= names(spliced["after"])
    assert count_ops(spliced["after"], "aten.slice") == len(partial)


def test_noop_expands_are_removed_broadcasts_kept(spliced, traced):
    before, after = spliced["before"], spliced["after"]
    assert spliced["noop_expand"] in names(before) and spliced["noop_expand"] not in names(after)
    # repeat_kv's expand of k and v in every layer broadcasts a new dimension: kept.
    assert count_ops(after, "aten.expand") == 2 * NUM_LAYERS
    assert spliced["ctx"].stats["noop_expands"] == count_ops(before, "aten.expand") - 2 * NUM_LAYERS >= 1


def test_real_casts_are_kept(spliced):
    after = spliced["after"]
    assert set(spliced["kept"][:2]) <= names(after)
    rope_cast = [node for node in after.graph.nodes if node.target is aten._to_copy.default
                 and node.args[0].meta["val"].dtype == torch.int64]
    assert len(rope_cast) == 1  # positions -> float32 for the rotary angles


def test_asserts_are_removed(spliced):
    before, after = spliced["before"], spliced["after"]
    asserts = count_ops(before, "aten._assert_tensor_metadata")
    assert asserts == 16
    assert count_ops(after, "aten._assert_tensor_metadata") == 0
    assert spliced["ctx"].stats["asserts"] == asserts


def test_dead_code_is_removed(spliced):
    assert set(spliced["dead"]) & names(spliced["after"]) == set()
    assert spliced["ctx"].stats["dead_nodes"] >= len(spliced["dead"])
    for node in spliced["after"].graph.nodes:
        assert node.op == "output" or node.users, f"{node.name} is dead but still in the graph"


def test_unused_weights_are_dropped(spliced):
    ctx, after = spliced["ctx"], spliced["after"]
    dropped = set(spliced["weights_before"]) - set(ctx.weights)
    assert dropped == {"model_rotary_emb_original_inv_freq"}  # a buffer the forward never reads
    assert ctx.stats["unused_weights"] == 1
    placeholders = [node.name for node in after.graph.nodes if node.op == "placeholder"]
    assert placeholders == [*ctx.weights, "input_ids", "positions"]


def test_outputs_are_unchanged(spliced, traced, token_inputs):
    expected = run_graph(traced.graph_module, traced.weights, **token_inputs)
    before = run_graph(spliced["before"], spliced["weights_before"], **token_inputs)
    after = run_graph(spliced["after"], spliced["ctx"].weights, **token_inputs)
    assert after.shape == (NUM_TOKENS, 49152)
    assert torch.equal(before, expected)  # the spliced ops are no-ops or exact round trips
    assert torch.equal(after, before)


def test_canonicalized_traced_graph_computes_the_same_logits(traced, model, token_inputs):
    ctx = make_context(traced, model)
    graph_module = canonicalize(clone_graph(traced.graph_module), ctx)
    graph_module.recompile()
    expected = run_graph(traced.graph_module, traced.weights, **token_inputs)
    assert torch.equal(run_graph(graph_module, ctx.weights, **token_inputs), expected)
    assert count_ops(graph_module, "aten.scaled_dot_product_attention") == 2  # attention itself untouched
    assert ctx.stats["aliases"] == 0 and ctx.stats["noop_casts"] == 0
