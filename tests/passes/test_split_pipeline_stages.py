"""split_pipeline_stages: the stage programs, run one after the other, compute the unsplit model's logits.

Stages run in one process (tests/passes/parallel_harness.py), each stage's
boundary values feeding the next. Splitting reorders no arithmetic, so a
pipeline alone matches to float32 rounding of the GEMMs on other buffers;
with tensor parallelism the tolerance argument of
test_shard_tensor_parallel applies (1e-5 absolute on logits of ~1-10).
"""

from __future__ import annotations

import pytest

from octavo.config import RankPosition
from octavo.errors import PassError
from octavo.ir.graph import count_ops
from octavo.passes.rank_program import prepare_rank_program
from octavo.passes.split_pipeline_stages import stage_layers
from octavo.runtime.loader import load_artifact
from tests.passes.test_shard_tensor_parallel import MODEL_TYPES, assert_layouts_compute_the_same_logits
from tests.tiny_models import COMMON

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = COMMON["hidden_size"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_two_stages_alone_and_with_two_ranks_each_compute_the_unsplit_logits(tiny_artifact, model_type):
    assert_layouts_compute_the_same_logits(load_artifact(tiny_artifact(model_type)), [(1, 2), (2, 2)])


def test_each_stage_keeps_its_layers_weights_and_caches(tiny_artifact):
    artifact = load_artifact(tiny_artifact("llama"))  # untied lm_head: the embedding is stage 0's alone
    first, last = (prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest,
                                        RankPosition(1, 0, 2, stage)) for stage in (0, 1))
    assert first.kv_layout["cache_inputs"] == [["key_cache_0", "value_cache_0"]]
    assert last.kv_layout["cache_inputs"] == [["key_cache_1", "value_cache_1"]]
    assert (first.kv_layout["num_layers"], last.kv_layout["first_layer"]) == (1, 1)
    assert "model_embed_tokens_weight" in first.weights and "model_embed_tokens_weight" not in last.weights
    assert "lm_head_weight" in last.weights and "lm_head_weight" not in first.weights
    assert not any("layers_1_" in name for name in first.weights)
    assert not any("layers_0_" in name for name in last.weights)
    # The residual stream and the last layer's MLP output cross, [1, T, hidden] each.
    boundary = [{"dtype": "float32", "shape": [1, "T", HIDDEN]}] * 2
    assert [{key: spec[key] for key in ("dtype", "shape")} for spec in first.pipeline_stage["outputs"]] == boundary
    assert [{key: spec[key] for key in ("dtype", "shape")} for spec in last.pipeline_stage["inputs"]] == boundary
    assert first.pipeline_stage["inputs"] == [] and last.pipeline_stage["outputs"] == []
    assert count_ops(first.graph_module, "octavo.paged_attention") == 1
    assert count_ops(first.graph_module, "aten.embedding") == 1 and count_ops(last.graph_module, "aten.embedding") == 0


def test_layers_are_split_evenly_and_contiguously():
    assert stage_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]


def test_more_stages_than_layers_is_an_error(tiny_artifact):
    artifact = load_artifact(tiny_artifact("llama"))
    with pytest.raises(PassError, match="pipeline parallel size 3 exceeds the 2 decoder layers"):
        prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, RankPosition(1, 0, 3, 0))
