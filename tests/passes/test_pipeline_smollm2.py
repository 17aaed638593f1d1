"""The bundled SmolLM2 (30 layers) after the whole default pipeline: one fused op structure per layer."""

from __future__ import annotations

import json

import pytest
import torch

from octavo.ir.artifact_format import GRAPH, MANIFEST
from octavo.ir.onnx_io import import_graph_from_onnx
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

LAYERS = 30
octavo = torch.ops.octavo
aten = torch.ops.aten


@pytest.fixture(scope="module")
def manifest(smollm2_fp32_artifact) -> dict:
    return json.loads((smollm2_fp32_artifact / MANIFEST).read_text())


@pytest.fixture(scope="module")
def graph(smollm2_fp32_artifact) -> torch.fx.Graph:
    return import_graph_from_onnx(smollm2_fp32_artifact / GRAPH).graph


def test_op_histogram_has_exactly_the_fused_layer_structure(manifest):
    histogram = manifest["op_histogram"]
    expected = {
        "octavo.rms_norm": 1,                       # the very first norm, on the embedding
        "octavo.fused_add_rms_norm": 2 * LAYERS,    # every other norm, the final one included
        "aten.linear": 4 * LAYERS + 1,              # qkv, o_proj, gate_up, down per layer; the lm_head
        "aten.split_with_sizes": LAYERS,            # q, k, v out of the qkv linear
        "octavo.rotary_embedding": LAYERS,
        "octavo.paged_attention": LAYERS,
        "octavo.silu_and_mul": LAYERS,
    }
    assert {op: histogram.get(op, 0) for op in expected} == expected
    leftovers = ("aten.mean.dim", "aten.rsqrt", "aten.pow.Tensor_Scalar", "aten.silu", "aten.mul.Tensor",
                 "aten.add.Tensor", "aten.cos", "aten.sin", "aten.neg", "aten.cat", "aten._to_copy",
                 "octavo.fused_pointwise")
    assert {op: histogram[op] for op in leftovers if op in histogram} == {}


def test_each_layer_reads_its_weights_through_the_fused_ops(graph):
    readers = {node.name: list(node.users) for node in graph.nodes if node.op == "placeholder"}

    def only_reader(weight: str) -> torch.fx.Node:
        (reader,) = readers[weight]
        return reader

    for layer in range(LAYERS):
        prefix = f"model_layers_{layer}_"
        first_norm = only_reader(prefix + "input_layernorm_weight")
        assert first_norm.target is (octavo.rms_norm.default if layer == 0 else octavo.fused_add_rms_norm.default)
        assert only_reader(prefix + "post_attention_layernorm_weight").target is octavo.fused_add_rms_norm.default
        for projection in ("self_attn_qkv_proj_weight", "self_attn_o_proj_weight", "mlp_down_proj_weight"):
            assert only_reader(prefix + projection).target is aten.linear.default
        gate_up = only_reader(prefix + "mlp_gate_up_proj_weight")
        assert [user.target for user in gate_up.users] == [octavo.silu_and_mul.default]
        assert prefix + "self_attn_q_proj_weight" not in readers
    final_norm = only_reader("model_norm_weight")
    assert final_norm.target is octavo.fused_add_rms_norm.default, "the final norm is fused with the last add"
    lm_rows = next(node for node in graph.nodes if node.target is aten.index_select.default)
    assert lm_rows.args[0].args == (final_norm, 0)
    rotary_readers = readers["rotary_cos_sin_cache"]
    assert len(rotary_readers) == LAYERS and all(node.target is octavo.rotary_embedding.default
                                                 for node in rotary_readers)


def test_pass_history_records_matches_and_node_counts(manifest):
    history = {record["name"]: record for record in manifest["passes"]}
    stats = {name: history[name]["stats"] for name in history}
    assert stats["fuse_rms_norm"]["rms_norms"] == 2 * LAYERS + 1
    assert stats["fuse_add_rms_norm"]["fused_add_rms_norms"] == 2 * LAYERS
    assert stats["fuse_qkv"] == {"merged_qkv": LAYERS, "merged_linears": 3 * LAYERS}
    assert stats["fuse_gate_up"] == {"merged_gate_up": LAYERS}
    assert stats["fuse_activation"] == {"silu_and_mul": LAYERS, "unmerged": 0}
    assert stats["fuse_rope"]["rotary_embeddings"] == LAYERS
    assert stats["fuse_rope"]["cache_positions"] == manifest["max_model_len"]
    before_fusion = history["fuse_rms_norm"]["nodes_before"]
    after_fusion = history["fuse_pointwise"]["nodes_after"]
    assert after_fusion == manifest["node_count"]
    assert after_fusion < 0.7 * before_fusion, (before_fusion, after_fusion)


def test_inspect_shows_the_per_layer_structure(manifest, smollm2_fp32_artifact):
    per_layer = ["aten.linear(self_attn_qkv_proj)", "octavo.rotary_embedding", "octavo.paged_attention",
                 "aten.linear(self_attn_o_proj)", "octavo.fused_add_rms_norm(post_attention_layernorm)",
                 "aten.linear(mlp_gate_up_proj)", "octavo.silu_and_mul", "aten.linear(mlp_down_proj)"]
    assert manifest["layers"] == [
        {"name": "embedding", "ops": ["aten.embedding(embed_tokens)"]},
        {"name": "layer 0", "ops": ["octavo.rms_norm(input_layernorm)", *per_layer]},
        {"name": f"layers 1-{LAYERS - 1}", "ops": ["octavo.fused_add_rms_norm(input_layernorm)", *per_layer]},
        {"name": "final", "ops": ["octavo.fused_add_rms_norm(norm)", "aten.index_select",
                                  "aten.linear(embed_tokens)"]},  # tied: the lm_head is the embedding
    ]
    result = run_cli("inspect", str(smollm2_fp32_artifact))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("per layer (ops in order, weight role in parentheses)")
    rows = dict(line.strip().split("  ", 1) for line in lines[start + 1:start + 5])
    assert {name: ops.strip() for name, ops in rows.items()} == {
        group["name"]: ", ".join(group["ops"]) for group in manifest["layers"]}
