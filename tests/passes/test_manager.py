"""The pass manager: pipeline resolution, per-pass verification and re-annotation, history, dumps, options.

Test-only passes are added to the registry with monkeypatch.setitem, which
removes them again after each test.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx import Graph, GraphModule

from octavo.config import CompileConfig
from octavo.errors import OctavoError, PassError
from octavo.frontend.architectures import architecture_for
from octavo.frontend.trace import trace_module
from octavo.ir.graph import format_graph, op_histogram
from octavo.passes import PASSES, PIPELINES, PassContext, run_pipeline
from octavo.passes.registry import PassInfo
from tests.tiny_models import VOCAB_SIZE, make_tiny_model

aten = torch.ops.aten
# The passes every pipeline starts with; tests run this list explicitly, so the fusion passes
# appended to the default pipeline do not change what they check.
PIPELINE = ["canonicalize", "match_attention", "prune_logits"]


@pytest.fixture(scope="module")
def llama():
    model = make_tiny_model("llama")
    return model, trace_module(model)


def clone_graph(graph_module: GraphModule) -> GraphModule:
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    return GraphModule(torch.nn.Module(), graph)


@pytest.fixture
def fresh(llama):
    """A factory of (graph copy, context) pairs for one pipeline run each."""
    model, traced = llama

    def make(**config) -> tuple[GraphModule, PassContext]:
        ctx = PassContext(config=CompileConfig(**config), weights=dict(traced.weights), model_config=model.config,
                          architecture=architecture_for(model.config), fake_mode=traced.fake_mode,
                          symbols={"T": traced.num_tokens})
        return clone_graph(traced.graph_module), ctx

    return make


def register(monkeypatch, name: str, function) -> None:
    monkeypatch.setitem(PASSES, name, PassInfo(name, f"test pass {name}", function))


def test_default_pipeline_starts_with_the_graph_rewrites():
    assert PIPELINES["default"][:3] == PIPELINE


# ---------------------------------------------------------------------------------------------- dumps


@pytest.fixture
def dumped(fresh, tmp_path):
    graph_module, ctx = fresh(dump_dir=str(tmp_path / "dumps"))
    traced_text = format_graph(graph_module, ctx.symbol_names())
    final = run_pipeline(graph_module, ctx, PIPELINE)
    return tmp_path / "dumps", traced_text, final, ctx


def test_dump_files_are_numbered_in_pipeline_order(dumped):
    directory, _, _, _ = dumped
    expected = {"00-traced.txt", "00-traced.json"}
    for index, name in enumerate(PIPELINE, 1):
        expected |= {f"{index:02d}-{name}.{suffix}" for suffix in ("txt", "json", "diff")}
    assert {path.name for path in directory.iterdir()} == expected


def test_dump_texts_are_the_graphs(dumped):
    directory, traced_text, final, ctx = dumped
    assert (directory / "00-traced.txt").read_text() == traced_text
    assert (directory / "03-prune_logits.txt").read_text() == format_graph(final, ctx.symbol_names())
    canonical = (directory / "01-canonicalize.txt").read_text()
    assert "_assert_tensor_metadata" in traced_text and "_assert_tensor_metadata" not in canonical
    assert "scaled_dot_product_attention" in canonical and "octavo.paged_attention" not in canonical


def test_dump_diffs_are_against_the_previous_pass(dumped):
    directory, _, _, _ = dumped
    diff = (directory / "02-match_attention.diff").read_text().splitlines()
    assert diff[:2] == ["--- 01-canonicalize", "+++ 02-match_attention"]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert sum("aten.scaled_dot_product_attention(" in line for line in removed) == 2
    assert sum("octavo.paged_attention(" in line for line in added) == 2
    assert not any("scaled_dot_product_attention(" in line for line in added)
    prune = (directory / "03-prune_logits.diff").read_text()
    assert "+%index_select_default" in prune and "+input %logits_indices: i64[N]" in prune


def test_dump_json_has_stats_histogram_and_time(dumped):
    directory, _, final, ctx = dumped
    traced = json.loads((directory / "00-traced.json").read_text())
    assert traced["op_histogram"]["aten.scaled_dot_product_attention"] == 2
    for index, name in enumerate(PIPELINE, 1):
        record = json.loads((directory / f"{index:02d}-{name}.json").read_text())
        history = ctx.history[index - 1]
        assert record["name"] == name and record["index"] == index
        assert record["stats"] == history["stats"] and record["time_s"] == history["time_s"]
        assert record["node_count"] == history["nodes_after"]
        assert record["op_histogram"] == history["op_histogram"]
    last = json.loads((directory / "03-prune_logits.json").read_text())
    assert last["op_histogram"] == op_histogram(final)
    lm_head = [node for node in final.graph.nodes if node.target is aten.linear.default][-1]
    assert last["stats"] == {"pruned_lm_head": lm_head.name}


# -------------------------------------------------------------------------------------------- history


def test_history_records_every_pass(fresh):
    graph_module, ctx = fresh()
    nodes = len(graph_module.graph.nodes)
    final = run_pipeline(graph_module, ctx, PIPELINE)
    assert [record["name"] for record in ctx.history] == PIPELINE
    assert [record["index"] for record in ctx.history] == [1, 2, 3]
    for record in ctx.history:
        assert record["nodes_before"] == nodes
        nodes = record["nodes_after"]
        assert isinstance(record["time_s"], float) and record["time_s"] >= 0
        assert record["description"] == PASSES[record["name"]].description
    assert nodes == len(final.graph.nodes)
    assert ctx.history[1]["stats"]["replaced_sdpa"] == 2
    assert ctx.history[1]["op_histogram"]["octavo.paged_attention"] == 2


# -------------------------------------------------------------------------------------------- options


def test_stop_after_stops(fresh, tmp_path):
    graph_module, ctx = fresh(stop_after="match_attention", dump_dir=str(tmp_path))
    final = run_pipeline(graph_module, ctx, PIPELINE)
    assert [record["name"] for record in ctx.history] == ["canonicalize", "match_attention"]
    assert "logits_indices" not in [node.name for node in final.graph.nodes if node.op == "placeholder"]
    assert not list(tmp_path.glob("03-*"))
    assert final.graph.output_node().args[0].meta["val"].shape[-1] == VOCAB_SIZE


def test_print_ir_after_calls_back(fresh):
    graph_module, ctx = fresh(print_ir_after=("canonicalize", "prune_logits"))
    printed: list[tuple[str, str]] = []
    final = run_pipeline(graph_module, ctx, PIPELINE, on_print_ir=lambda name, text: printed.append((name, text)))
    assert [name for name, _ in printed] == ["canonicalize", "prune_logits"]
    assert "aten.scaled_dot_product_attention(" in printed[0][1]
    assert printed[1][1] == format_graph(final, ctx.symbol_names())


@pytest.mark.parametrize("option", ["stop_after", "print_ir_after"])
def test_options_naming_no_pass_of_the_pipeline_are_errors(fresh, option):
    value = "fuse_everything" if option == "stop_after" else ("fuse_everything",)
    graph_module, ctx = fresh(**{option: value})
    with pytest.raises(PassError, match="fuse_everything: not a pass of this pipeline"):
        run_pipeline(graph_module, ctx, PIPELINE)
    assert ctx.history == []  # checked before any pass ran


@pytest.mark.parametrize("name", ["match_attention", "prune_logits"])
def test_disabling_a_required_pass_is_an_error(fresh, name):
    graph_module, ctx = fresh(disabled_passes=(name,))
    with pytest.raises(PassError, match=f"pass {name} cannot be disabled"):
        run_pipeline(graph_module, ctx, PIPELINE)


def test_disabling_an_optional_pass_skips_it(fresh):
    graph_module, ctx = fresh(disabled_passes=("canonicalize",))
    run_pipeline(graph_module, ctx, PIPELINE)
    assert [record["name"] for record in ctx.history] == ["match_attention", "prune_logits"]


@pytest.mark.parametrize("where", ["pipeline", "disabled"])
def test_unknown_pass_names_are_errors(fresh, where):
    if where == "pipeline":
        graph_module, ctx = fresh()
        pipeline = ["canonicalize", "fuse_everything"]
    else:
        graph_module, ctx = fresh(disabled_passes=("fuse_everything",))
        pipeline = PIPELINE
    with pytest.raises(PassError, match=r"unknown pass 'fuse_everything'; known passes: .*canonicalize"):
        run_pipeline(graph_module, ctx, pipeline)


# --------------------------------------------------------------------------- failures and verification


def test_ordinary_exception_in_a_pass_becomes_pass_error(fresh, monkeypatch):
    def explode(graph_module, ctx):
        raise ValueError("the pattern table is empty")

    register(monkeypatch, "explode", explode)
    graph_module, ctx = fresh()
    with pytest.raises(PassError, match="pass explode failed: ValueError: the pattern table is empty") as caught:
        run_pipeline(graph_module, ctx, ["canonicalize", "explode"])
    assert isinstance(caught.value.__cause__, ValueError)
    assert [record["name"] for record in ctx.history] == ["canonicalize"]


def test_octavo_errors_from_a_pass_pass_through_unchanged(fresh):
    graph_module, ctx = fresh()
    graph_module = run_pipeline(graph_module, ctx, ["match_attention"])
    with pytest.raises(PassError, match=r"^match_attention found no scaled_dot_product_attention"):
        run_pipeline(graph_module, ctx, ["match_attention"])


def test_graph_is_verified_after_each_pass(fresh, monkeypatch):
    def helper_outside_the_op_set(tensor):
        return tensor

    def smuggle(graph_module, ctx):
        output = graph_module.graph.output_node()
        with graph_module.graph.inserting_before(output):
            call = graph_module.graph.call_function(helper_outside_the_op_set, (output.args[0],))
        output.args = (call,)
        return graph_module

    register(monkeypatch, "smuggle", smuggle)
    graph_module, ctx = fresh()
    with pytest.raises(OctavoError, match=r"helper_outside_the_op_set.*outside the Octavo op set"):
        run_pipeline(graph_module, ctx, ["smuggle"])


def test_shapes_are_propagated_after_each_pass(fresh, monkeypatch):
    """A pass that adds a node without meta and changes downstream shapes: the manager re-annotates all."""

    def first_three_tokens(graph_module, ctx):
        lm_head = [node for node in graph_module.graph.nodes if node.target is aten.linear.default][-1]
        hidden = lm_head.args[0]
        with graph_module.graph.inserting_before(lm_head):
            sliced = graph_module.graph.call_function(aten.slice.Tensor, (hidden, 1, 0, 3))
        lm_head.replace_input_with(hidden, sliced)
        return graph_module

    register(monkeypatch, "first_three_tokens", first_three_tokens)
    graph_module, ctx = fresh()
    output = graph_module.graph.output_node().args[0]
    assert output.meta["val"].shape[0] == ctx.symbols["T"]
    final = run_pipeline(graph_module, ctx, ["first_three_tokens"])
    (sliced,) = [node for node in final.graph.nodes if node.target is aten.slice.Tensor and node.args[3] == 3]
    assert tuple(sliced.meta["val"].shape) == (1, 3, 64)
    assert tuple(final.graph.output_node().args[0].meta["val"].shape) == (3, VOCAB_SIZE)


def test_shape_propagation_failure_is_a_pass_error(fresh, monkeypatch):
    def mismatch(graph_module, ctx):
        lm_head = [node for node in graph_module.graph.nodes if node.target is aten.linear.default][-1]
        with graph_module.graph.inserting_before(lm_head):
            narrowed = graph_module.graph.call_function(aten.slice.Tensor, (lm_head.args[0], 2, 0, 7))
        lm_head.replace_input_with(lm_head.args[0], narrowed)  # 7 features into a 64-feature linear
        return graph_module

    register(monkeypatch, "mismatch", mismatch)
    graph_module, ctx = fresh()
    with pytest.raises(PassError, match="shape propagation failed"):
        run_pipeline(graph_module, ctx, ["mismatch"])
