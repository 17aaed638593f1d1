"""fuse_rope: rotate_half RoPE on q and k -> octavo.rotary_embedding over a compile-time cos/sin cache."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo.errors import PassError
from octavo.frontend.trace import trace_module
from tests.passes.fusion_harness import (
    ALL_PASSES,
    DTYPES,
    MODEL_TYPES,
    assert_bitwise_equal,
    compile_traced,
    compiled,
    outputs,
    passes_before,
    passes_through,
    run_steps,
    traced_model,
)
from tests.tiny_models import COMMON, tiny_config

LAYERS = COMMON["num_hidden_layers"]
MAX_POSITIONS = COMMON["max_position_embeddings"]
PASS = "fuse_rope"


def hf_cos_sin(model, dtype: torch.dtype) -> torch.Tensor:
    """The model's own rotary module evaluated at every position, stacked as [positions, 2, head_dim]."""
    probe = torch.empty(0, dtype=dtype)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(probe, torch.arange(MAX_POSITIONS).unsqueeze(0))
    return torch.stack([cos[0], sin[0]], dim=1)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_op_counts_before_and_after(model_type):
    before = compiled(model_type, "bfloat16", passes_before(PASS))
    after = compiled(model_type, "bfloat16", passes_through(PASS))
    assert (before.count("octavo.rotary_embedding"), after.count("octavo.rotary_embedding")) == (0, LAYERS)
    assert (before.count("aten.cos"), before.count("aten.sin")) == (1, 1)
    assert before.count("aten.neg") == 2 * LAYERS and before.count("aten.cat") == 2 * LAYERS + 1
    for op in ("aten.cos", "aten.sin", "aten.neg", "aten.cat", "aten.mul", "aten.add", "aten._to_copy"):
        assert after.count(op) == 0, op
    stats = after.stats(PASS)
    assert stats["rotary_embeddings"] == LAYERS and stats["unpaired"] == 0
    assert stats["cache_positions"] == MAX_POSITIONS and stats["unused_weights"] == 1  # inv_freq
    assert not any("inv_freq" in name for name in after.ctx.weights)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cache_holds_hf_cos_and_sin_for_every_position(model_type, dtype):
    model, _ = traced_model(model_type, dtype)
    cache = compiled(model_type, dtype, passes_through(PASS)).ctx.weights["rotary_cos_sin_cache"]
    expected = hf_cos_sin(model, getattr(torch, dtype))
    assert cache.dtype == expected.dtype and torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outputs_bitwise_equal_before_and_after(model_type, dtype):
    assert_bitwise_equal(outputs(model_type, dtype, passes_before(PASS)),
                         outputs(model_type, dtype, passes_through(PASS)))


@functools.cache
def yarn_llama():
    """A tiny llama with YaRN scaling: other inverse frequencies and an attention factor (cos, sin scaled by 1.139)."""
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 128}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.08)
    return model, trace_module(model)


def test_scaled_rope_is_reproduced_exactly():
    model, traced = yarn_llama()
    assert model.model.rotary_emb.attention_scaling > 1.1
    before = compile_traced(model, traced, "float32", passes_before(PASS))
    after = compile_traced(model, traced, "float32", ALL_PASSES)
    assert torch.equal(after.ctx.weights["rotary_cos_sin_cache"], hf_cos_sin(model, torch.float32))
    assert_bitwise_equal(run_steps(before), run_steps(after))


def test_a_second_run_finds_nothing_and_fails():
    with pytest.raises(PassError, match="found no rotate_half RoPE"):
        compiled("llama", "float32", (*passes_through(PASS), PASS))


def test_longrope_rows_are_hfs_rotation_of_each_position_as_the_newest_token(tiny_model_dir, tiny_artifact):
    """Phi-3's longrope picks short or long factors by the batch's largest position: row p of the cache is what HF
    computes for position p when p is the last position it sees (generation over a KV cache), so short factors
    below original_max_position_embeddings and long ones from there on, both in one table."""
    from safetensors.torch import load_file

    from tests.tiny_models import PHI3_ORIGINAL_CONTEXT

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("phi3"), dtype=torch.float32).eval()
    cache = load_file(str(tiny_artifact("phi3") / "weights.safetensors"))["rotary_cos_sin_cache"]
    probe = torch.empty(0)
    expected = []
    with torch.no_grad():
        for position in range(MAX_POSITIONS):
            cos, sin = model.model.rotary_emb(probe, torch.arange(position + 1).unsqueeze(0))
            expected.append(torch.stack([cos[0, -1], sin[0, -1]]))
    expected = torch.stack(expected)
    assert cache.shape == expected.shape == (MAX_POSITIONS, 2, 12)
    assert torch.equal(cache, expected)
    short, long = expected[PHI3_ORIGINAL_CONTEXT - 1], expected[PHI3_ORIGINAL_CONTEXT]
    with torch.no_grad():  # the two halves really use different factors
        everything = model.model.rotary_emb(probe, torch.arange(MAX_POSITIONS).unsqueeze(0))[0][0]
    assert not torch.equal(everything[:PHI3_ORIGINAL_CONTEXT], expected[:PHI3_ORIGINAL_CONTEXT, 0])
    assert not torch.equal(short, long)
