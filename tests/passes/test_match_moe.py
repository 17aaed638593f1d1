"""match_moe: every sparse MoE block of a traced mixture of experts becomes one octavo.moe, nothing else.

The compiled tiny artifacts (shared with tests/test_architectures.py, which checks their logits and routing
against HF) give the pass's record; a hand-made block that is not the batched-experts form is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx import GraphModule

from octavo.config import CompileConfig
from octavo.errors import PassError
from octavo.frontend.architectures import ARCHITECTURES
from octavo.passes import PassContext
from octavo.passes.match_moe import match_moe
from octavo.runtime.loader import read_manifest
from tests.tiny_models import COMMON

LAYERS = COMMON["num_hidden_layers"]
EXPECTED = {  # model_type: (top-k weights renormalized, activation)
    "qwen3_moe": (LAYERS, "silu"), "qwen2_moe": (0, "silu"), "mixtral": (LAYERS, "silu"), "olmoe": (0, "silu")}


def pass_stats(artifact, name: str) -> dict:
    return next(record["stats"] for record in read_manifest(artifact)["passes"] if record["name"] == name)


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_each_block_becomes_one_moe_op(model_type, tiny_artifact):
    artifact = tiny_artifact(model_type)
    stats = pass_stats(artifact, "match_moe")
    normalized, activation = EXPECTED[model_type]
    assert stats["moe_blocks"] == LAYERS and stats["experts"] == 4 and stats["top_k"] == 2
    assert (stats["normalized"], stats["activation"]) == (normalized, activation)
    histogram = read_manifest(artifact)["op_histogram"]
    assert histogram["octavo.moe"] == LAYERS
    for op in ("aten.topk", "aten.bmm", "aten.index", "aten.repeat_interleave", "aten.softmax"):
        assert op not in histogram, op


def test_a_dense_model_has_no_block(tiny_artifact):
    assert pass_stats(tiny_artifact("llama"), "match_moe") == {"moe_blocks": 0, "dead_nodes": 0}


class _TopKOfScores(torch.nn.Module):
    """A router whose top-k values are returned instead of weighting experts: not a MoE block."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        probabilities = torch.softmax(torch.nn.functional.linear(x, self.router), -1, dtype=torch.float32)
        values, _ = torch.topk(probabilities, 2)
        return values


def test_a_top_k_router_in_another_form_is_refused():
    program = torch.export.export(_TopKOfScores(), (torch.randn(5, 8),)).run_decompositions({})
    graph_module = GraphModule(program.graph_module, program.graph_module.graph)
    weights = {node.name: program.state_dict[spec.target] for node, spec in
               zip(graph_module.graph.find_nodes(op="placeholder"), program.graph_signature.input_specs, strict=False)
               if spec.target in program.state_dict}
    ctx = PassContext(config=CompileConfig(dtype="float32"), weights=weights, model_config=None,
                      architecture=ARCHITECTURES["mixtral"], fake_mode=None, symbols={})
    with pytest.raises(PassError, match=r"match_moe: the router top-k topk is not a supported MoE block: its values"):
        match_moe(graph_module, ctx)
