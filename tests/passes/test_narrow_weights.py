"""narrow_weights: a float32 artifact's linear and embedding weights stored in 16 bits, widened where read.

The narrowed graph must compute exactly the float32 model over the rounded weights: on the torch
backend (whose linear_w16 widens and runs aten.linear) its outputs equal, bit for bit, those of the
un-narrowed graph given the rounded-then-widened weights. End to end, a narrowed artifact run by the
engine (backend auto: the C++ linear_w16 where the CPU kernels build) matches Hugging Face's model
with the same rounded weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo.compiler import compile_model
from octavo.config import CompileConfig
from octavo.errors import OctavoError
from octavo.ir.graph import op_histogram
from octavo.passes import resolve_pipeline, run_pipeline
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import run_cli
from tests.passes.fusion_harness import ALL_PASSES, Compiled, assert_bitwise_equal, clone_graph, compiled, run_steps

aten = torch.ops.aten
WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def plain(model_type: str) -> Compiled:
    """The default pipeline without narrow_weights (shared with the fusion tests, which must not modify it)."""
    return compiled(model_type, "float32", tuple(ALL_PASSES))


@functools.cache
def narrowed(model_type: str, weight_dtype: str) -> Compiled:
    """narrow_weights run on a copy of the plain graph, as the last pass of the default pipeline."""
    before = plain(model_type)
    ctx = dataclasses.replace(before.ctx, config=CompileConfig(dtype="float32", weight_dtype=weight_dtype),
                              weights=dict(before.ctx.weights), stats={}, history=list(before.ctx.history))
    return Compiled(run_pipeline(clone_graph(before.graph_module), ctx, ["narrow_weights"]), ctx)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"], ids=["untied", "tied"])
def test_every_linear_reads_a_narrow_weight(model_type):
    narrow = narrowed(model_type, "bfloat16")
    linears = plain(model_type).count("aten.linear")
    assert narrow.count("aten.linear") == 0
    assert narrow.count("octavo.linear_w16") == linears
    embeddings = [node for node in narrow.graph_module.graph.nodes if node.target is aten.embedding.default]
    assert [next(iter(node.users)).target for node in embeddings] == [aten._to_copy.default]
    table = embeddings[0].args[0]
    tied = any(user.target is torch.ops.octavo.linear_w16.default for user in table.users)
    assert tied == (model_type == "qwen2")  # the lm_head reads the narrowed embedding table itself
    for node in narrow.graph_module.graph.nodes:
        if node.target is torch.ops.octavo.linear_w16.default:
            weight = narrow.ctx.weights[node.args[1].name]
            assert weight.dtype == torch.bfloat16
            assert torch.equal(weight, plain(model_type).ctx.weights[node.args[1].name].to(torch.bfloat16))
            bias = node.args[2]
            assert bias is None or narrow.ctx.weights[bias.name].dtype == torch.float32
    stats = narrow.stats("narrow_weights")
    assert stats["linears"] == linears and stats["embeddings"] == len(embeddings)
    saved = sum(tensor.numel() * 2 for tensor in narrow.ctx.weights.values() if tensor.dtype == torch.bfloat16)
    assert stats["bytes_saved"] == saved > 0


def test_nothing_changes_without_a_weight_dtype():
    before = plain("llama")
    ctx = dataclasses.replace(before.ctx, config=CompileConfig(dtype="float32"), weights=dict(before.ctx.weights),
                              stats={}, history=[])
    after = run_pipeline(clone_graph(before.graph_module), ctx, ["narrow_weights"])
    assert ctx.history[0]["stats"] == {"weight_dtype": "float32", "linears": 0}
    assert op_histogram(after) == before.histogram()
    assert all(ctx.weights[name] is tensor for name, tensor in before.ctx.weights.items())


@pytest.mark.parametrize(("model_type", "weight_dtype"), [("llama", "bfloat16"), ("qwen2", "bfloat16"),
                                                          ("llama", "float16")])
def test_outputs_equal_the_float32_graph_over_rounded_weights(model_type, weight_dtype):
    before, narrow = plain(model_type), narrowed(model_type, weight_dtype)
    rounded = {name: tensor.to(WEIGHT_DTYPES[weight_dtype]).float()
               if narrow.ctx.weights[name].dtype != torch.float32 else tensor
               for name, tensor in before.ctx.weights.items()}
    assert_bitwise_equal(run_steps(narrow), run_steps(before, weights=rounded))


def test_weight_dtype_needs_float32_compute():
    with pytest.raises(OctavoError, match="--weight-dtype float16 needs float32 compute"):
        CompileConfig(dtype="bfloat16", weight_dtype="float16")


@pytest.fixture(scope="module")
def narrowed_artifact(tiny_model_dir, tmp_path_factory):
    config = CompileConfig(dtype="float32", weight_dtype="bfloat16")
    return compile_model(tiny_model_dir("qwen2"), tmp_path_factory.mktemp("narrowed") / "artifact", config)


def test_artifact_matches_hugging_face_over_the_same_rounded_weights(narrowed_artifact, tiny_model_dir):
    """Greedy steps (prefill, then decodes) of the engine against HF's float32 model with bf16-rounded weights.

    Tolerance 1e-4: both compute in float32 over identical weights, in other summation orders, through
    two layers (the same bound the float32 artifacts meet against HF).
    """
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            if parameter.dim() == 2:  # every linear and the (tied) embedding; norms stay float32
                parameter.copy_(parameter.to(torch.bfloat16).float())
    engine = LLMEngine(narrowed_artifact)
    assert engine.artifact.manifest["weight_dtype"] == "bfloat16"
    prompt = torch.randint(3, 49000, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    worst = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.last_step.schedule.scheduled[0].seq
        with torch.no_grad():
            expected = reference(torch.tensor([seq.token_ids[:seq.num_computed_tokens]])).logits[0, -1]
        worst = max(worst, (expected - engine.last_step.logits[0]).abs().max().item())
    assert worst <= 1e-4, f"max abs logits difference {worst}"


def test_only_configs_that_narrow_run_the_pass(narrowed_artifact):
    def names(config):
        return [info.name for info in resolve_pipeline("default", (), config)]

    narrowing = CompileConfig(dtype="float32", weight_dtype="bfloat16")
    assert names(narrowing)[-1] == "narrow_weights"
    assert "narrow_weights" not in names(CompileConfig(dtype="float32")) + names(CompileConfig(dtype="bfloat16"))
    manifest = json.loads((narrowed_artifact / "manifest.json").read_text())
    assert [record["name"] for record in manifest["passes"]] == names(narrowing)
    assert manifest["passes"][-1]["stats"]["weight_dtype"] == manifest["weight_dtype"] == "bfloat16"
    with pytest.raises(OctavoError, match="cannot be disabled"):
        resolve_pipeline("default", ("narrow_weights",), narrowing)


def test_inspect_shows_the_weight_storage(narrowed_artifact):
    result = run_cli("inspect", str(narrowed_artifact))
    assert result.returncode == 0, result.stderr
    assert "dtype    float32, weights bfloat16" in result.stdout
    assert "octavo.linear_w16" in result.stdout
