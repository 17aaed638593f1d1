"""Fused graphs survive graph.onnx: every new op (Tensor[] and str arguments, tuple results) round-trips exactly."""

from __future__ import annotations

import onnx
import pytest
import torch

from octavo.compiler import input_specs
from octavo.ir.graph import op_histogram
from octavo.ir.onnx_io import export_graph_to_onnx, import_graph_from_onnx
from octavo.runtime.loader import load_artifact
from tests.passes.fusion_harness import (
    ALL_PASSES,
    FUSION_PASSES,
    MODEL_TYPES,
    assert_bitwise_equal,
    compiled,
    outputs,
    run_steps,
)

FUSED_OPS = ("octavo.rms_norm", "octavo.fused_add_rms_norm", "octavo.rotary_embedding", "octavo.silu_and_mul")


def round_trip(result) -> torch.fx.GraphModule:
    model = export_graph_to_onnx(result.graph_module, input_specs(result.graph_module, result.ctx))
    onnx.checker.check_model(model)
    return import_graph_from_onnx(onnx.load_from_string(model.SerializeToString()))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fully_fused_graph_round_trips_and_computes_the_same(model_type):
    result = compiled(model_type, "float32", tuple(ALL_PASSES))
    restored = round_trip(result)
    assert op_histogram(restored) == op_histogram(result.graph_module)
    assert all(op_histogram(restored).get(op) for op in FUSED_OPS)
    assert_bitwise_equal(outputs(model_type, "float32", tuple(ALL_PASSES)), run_steps(result, restored))


def test_partitioner_groups_round_trip_with_their_programs():
    disabled = tuple(name for name in FUSION_PASSES if name != "fuse_pointwise")
    result = compiled("qwen3", "bfloat16", tuple(ALL_PASSES), disabled)
    restored = round_trip(result)
    original = [node for node in result.graph_module.graph.nodes
                if node.target is torch.ops.octavo.fused_pointwise.default]
    again = [node for node in restored.graph.nodes if node.target is torch.ops.octavo.fused_pointwise.default]
    assert len(original) == len(again) > 0
    for before, after in zip(original, again, strict=True):
        assert after.args[1] == before.args[1]
        assert [node.name for node in after.args[0]] == [node.name for node in before.args[0]]
    assert_bitwise_equal(run_steps(result), run_steps(result, restored))


def test_compiled_artifact_holds_the_fused_graph(tiny_artifact):
    artifact = load_artifact(tiny_artifact("llama"))
    manifest = artifact.manifest
    assert [record["name"] for record in manifest["passes"]] == ALL_PASSES
    assert op_histogram(artifact.graph_module) == manifest["op_histogram"]
    assert "rotary_cos_sin_cache" in artifact.weights
    # The artifact's graph and weights compute what the same model compiled in memory computes.
    reference = compiled("llama", "float32", tuple(ALL_PASSES))
    assert_bitwise_equal(run_steps(reference), run_steps(reference, artifact.graph_module, artifact.weights))
    assert op_histogram(artifact.graph_module) == reference.histogram()
