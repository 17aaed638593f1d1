"""shard_tensor_parallel: the programs of all ranks, run together, compute the unsharded model's logits.

The ranks run in one process (tests/passes/parallel_harness.py): each
collective is evaluated from every rank's value by the op's reference
definition. Tolerance: float32 logits of magnitude ~1-10; sharding changes
only the order of the sums in o_proj, down_proj (partial sums per rank, then
added) and the vocabulary-split embedding, i.e. a few float32 roundings of
relative size 2^-24 per sum, far below 1e-5 absolute.
"""

from __future__ import annotations

import pytest
import torch

from octavo.config import RankPosition
from octavo.errors import PassError
from octavo.ir.graph import count_ops
from octavo.ir.onnx_io import export_graph_to_onnx, import_graph_from_onnx
from octavo.passes.rank_program import prepare_rank_program
from octavo.runtime.loader import load_artifact
from tests.passes.parallel_harness import ParallelPrograms, mixed_steps
from tests.tiny_models import COMMON

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LAYERS = COMMON["num_hidden_layers"]
ATOL = 1e-5
aten = torch.ops.aten


@pytest.fixture(scope="module")
def artifacts(tiny_artifact):
    loaded = {}

    def get(model_type: str):
        if model_type not in loaded:
            loaded[model_type] = load_artifact(tiny_artifact(model_type))
        return loaded[model_type]

    return get


def assert_layouts_compute_the_same_logits(artifact, layouts: list[tuple[int, int]]) -> None:
    steps = mixed_steps(artifact.manifest["vocab_size"])
    reference = ParallelPrograms.prepare(artifact, 1, 1)
    expected = [reference.run(step) for step in steps]
    for tp_size, pp_size in layouts:
        programs = ParallelPrograms.prepare(artifact, tp_size, pp_size)
        for index, (step, logits) in enumerate(zip(steps, expected, strict=True)):
            where = f"tp {tp_size} pp {pp_size} step {index}"
            torch.testing.assert_close(programs.run(step), logits, rtol=0, atol=ATOL,
                                       msg=lambda text, where=where: f"{where}: {text}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_two_and_four_ranks_compute_the_unsharded_logits(artifacts, model_type):
    # 4 query heads / 2 KV heads: tp 2 splits both, tp 4 replicates each KV head on two ranks.
    assert_layouts_compute_the_same_logits(artifacts(model_type), [(2, 1), (4, 1)])


def test_three_ranks_replicate_the_only_kv_head_and_pad_the_vocabulary(tiny_mqa_artifact):
    artifact = load_artifact(tiny_mqa_artifact)
    programs = [prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest,
                                     RankPosition(3, rank)) for rank in range(3)]
    k_proj = artifact.weights["model_layers_0_self_attn_k_proj_weight"]
    for program in programs:
        assert (program.kv_layout["num_heads"], program.kv_layout["num_kv_heads"]) == (2, 1)
        torch.testing.assert_close(program.weights["model_layers_0_self_attn_k_proj_weight"], k_proj, rtol=0, atol=0)
        assert program.weights["lm_head_weight"].shape == (16385, 96)  # ceil(49153 / 3) rows
    padding = programs[2].weights["lm_head_weight"][49153 - 2 * 16385:]
    assert padding.shape[0] == 2 and not padding.any()
    assert_layouts_compute_the_same_logits(artifact, [(3, 1), (6, 1)])


def test_rank_program_ops_and_weight_slices(artifacts):
    artifact = artifacts("llama")
    program = prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(2, 1))
    graph = program.graph_module
    assert count_ops(graph, "octavo.all_reduce") == 2 * LAYERS + 1  # o_proj, down_proj per layer; embedding
    assert count_ops(graph, "octavo.all_gather") == 1  # lm_head
    assert program.history[0]["stats"] == {"tp_size": 2, "tp_rank": 1, "attention_layers": LAYERS,
                                           "mlp_layers": LAYERS, "all_reduce": 2 * LAYERS + 1, "all_gather": 1}
    assert (program.kv_layout["num_heads"], program.kv_layout["num_kv_heads"]) == (2, 1)
    qkv = artifact.weights["model_layers_0_self_attn_qkv_proj_weight"]  # rows: q heads 0-3, k 0-1, v 0-1 (x16)
    expected = torch.cat([qkv[32:64], qkv[64 + 16:64 + 32], qkv[96 + 16:96 + 32]])
    torch.testing.assert_close(program.weights["model_layers_0_self_attn_qkv_proj_weight"], expected, rtol=0, atol=0)
    down = artifact.weights["model_layers_0_mlp_down_proj_weight"]
    torch.testing.assert_close(program.weights["model_layers_0_mlp_down_proj_weight"], down[:, 64:], rtol=0, atol=0)
    # A slice of whole rows is a view of the memory-mapped artifact: the rank reads only its pages.
    embedding = program.weights["model_embed_tokens_weight"]
    whole = artifact.weights["model_embed_tokens_weight"]
    assert embedding.shape == (whole.shape[0] // 2, whole.shape[1])
    assert embedding.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_sizes_that_do_not_divide_are_named(artifacts):
    artifact = artifacts("llama")
    with pytest.raises(PassError, match="tensor parallel size 3 does not divide the 4 attention heads"):
        prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(3, 0))
    with pytest.raises(PassError, match="tensor parallel size 8 does not divide the 4 attention heads"):
        prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(8, 0))


def test_an_op_it_cannot_shard_is_named(artifacts):
    artifact = artifacts("llama")
    graph_module = load_artifact(artifact.path).graph_module
    graph = graph_module.graph
    pruned = next(node for node in graph.nodes if node.target is aten.index_select.default)
    norm_weight = next(node for node in graph.find_nodes(op="placeholder") if node.name == "model_norm_weight")
    with graph.inserting_after(pruned):
        scaled = graph.call_function(aten.mul.Tensor, (pruned, norm_weight))
    pruned.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    graph_module.recompile()
    message = r"cannot shard aten\.mul\.Tensor \(mul_tensor\) \(it reads weight model_norm_weight\)"
    with pytest.raises(PassError, match=message):
        prepare_rank_program(graph_module, artifact.weights, artifact.manifest, RankPosition(2, 0))


def test_an_embedding_with_a_padding_index_is_sharded(artifacts):
    # GGUF models (SmolLM2) trace embedding(weight, ids, padding_idx): the index only matters for gradients.
    artifact = artifacts("llama")
    graph_module = load_artifact(artifact.path).graph_module
    embedding = next(node for node in graph_module.graph.nodes if node.target is aten.embedding.default)
    embedding.args = (*embedding.args[:2], 2)
    graph_module.recompile()
    program = prepare_rank_program(graph_module, artifact.weights, artifact.manifest, RankPosition(2, 1))
    sharded = next(node for node in program.graph_module.graph.nodes if node.target is aten.embedding.default)
    assert len(sharded.args) == 2 and sharded.args[1].target is aten.masked_fill.Scalar


def test_rank_program_round_trips_through_graph_onnx(artifacts):
    artifact = artifacts("qwen2")
    program = prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(2, 0))
    model = export_graph_to_onnx(program.graph_module)
    domains = {node.op_type: node.domain for node in model.graph.node}
    assert domains["all_reduce"] == domains["all_gather"] == "ai.octavo"
    restored = import_graph_from_onnx(model)
    collectives = [(node.name, node.target, node.args[1:]) for node in restored.graph.nodes
                   if node.op == "call_function" and "all_" in str(node.target)]
    assert collectives == [(node.name, node.target, node.args[1:]) for node in program.graph_module.graph.nodes
                           if node.op == "call_function" and "all_" in str(node.target)]
    assert len(collectives) == 2 * LAYERS + 2


# The quantized artifacts the quantization and engine tests build too (shared through the session).
QUANTIZED = [{"quant": "w4", "kv_cache_dtype": "int8"}, {"quant": "w8", "vocab_quant": "w4"}]


@pytest.mark.parametrize("options", QUANTIZED, ids=["w4-int8kv", "w8-w4vocab"])
def test_quantized_linears_split_with_their_scales(tiny_quantized_artifact, options):
    """The ops' reference definitions dequantize in float32, so sharding reorders float32 sums only (ATOL)."""
    artifact = load_artifact(tiny_quantized_artifact("llama", **options))
    assert_layouts_compute_the_same_logits(artifact, [(2, 1)])
    program = prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(2, 1))
    prefix = "model_layers_0_mlp_down_proj"
    full, local = artifact.weights[f"{prefix}_qweight"], program.weights[f"{prefix}_qweight"]
    columns = full.shape[1] // 2  # rank 1 of 2: the second half of the input features (w4: of the bytes)
    torch.testing.assert_close(local, full[:, columns:], rtol=0, atol=0)
    weight = next(node for node in program.graph_module.graph.find_nodes(op="placeholder")
                  if node.name == f"{prefix}_qweight")
    (down,) = weight.users
    group_size = down.args[-1]
    groups = artifact.weights[f"{prefix}_scales"].shape[1]
    if groups > 1:  # group-wise scales: the rank keeps the scale columns of its own groups
        torch.testing.assert_close(program.weights[f"{prefix}_scales"],
                                   artifact.weights[f"{prefix}_scales"][:, groups // 2:], rtol=0, atol=0)
    else:  # one scale per row: kept whole, the group becomes the rank's columns
        assert group_size == full.shape[1] // 2


def test_a_quantization_group_that_would_straddle_two_ranks_is_named(tiny_quantized_artifact):
    artifact = load_artifact(tiny_quantized_artifact("llama", quant="w4", kv_cache_dtype="int8"))
    # 4 ranks: o_proj's 64 input features give each rank 16, half a group of 32.
    with pytest.raises(PassError, match=r"rank columns \[0, 16\) of 64 cut a quantization group of 32 columns"):
        prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(4, 0))


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_experts_split_by_intermediate_columns_compute_the_unsharded_logits(artifacts, model_type):
    """Qwen2-MoE adds a shared expert (a gated MLP) behind a one-feature sigmoid gate, computed whole on each rank."""
    assert_layouts_compute_the_same_logits(artifacts(model_type), [(2, 1), (4, 1)])


def test_expert_weight_slices_of_a_rank(artifacts):
    artifact = artifacts("qwen2_moe")
    program = prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(2, 1))
    stats = program.history[0]["stats"]
    assert stats["moe_layers"] == LAYERS and stats["mlp_layers"] == LAYERS  # the shared experts
    gate_up = artifact.weights["model_layers_0_mlp_experts_gate_up_proj"]  # [4 experts, 2 x 32, 64]
    expected = torch.cat([gate_up[:, 16:32], gate_up[:, 48:64]], dim=1)
    torch.testing.assert_close(program.weights["model_layers_0_mlp_experts_gate_up_proj"], expected, rtol=0, atol=0)
    down = artifact.weights["model_layers_0_mlp_experts_down_proj"]  # [4, 64, 32]
    torch.testing.assert_close(program.weights["model_layers_0_mlp_experts_down_proj"], down[:, :, 16:],
                               rtol=0, atol=0)
    router = "model_layers_0_mlp_gate_weight"
    torch.testing.assert_close(program.weights[router], artifact.weights[router], rtol=0, atol=0)


def test_experts_that_do_not_divide_are_named(artifacts):
    artifact = artifacts("mixtral")  # expert intermediate size 32
    with pytest.raises(PassError, match="tensor parallel size 3 does not divide"):
        prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(3, 0))
