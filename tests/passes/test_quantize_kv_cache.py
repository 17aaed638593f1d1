"""quantize_kv_cache: int8 / fp8 caches with per-token, per-head float32 scale pools as graph inputs."""

from __future__ import annotations

import functools

import pytest
import torch

from octavo.config import CompileConfig
from octavo.errors import PassError
from octavo.frontend.architectures import architecture_for
from octavo.passes import PassContext, run_pipeline
from tests.passes.fusion_harness import ALL_PASSES, Compiled, clone_graph, compiled, run_steps, traced_model
from tests.tiny_models import COMMON

LAYERS, KV_HEADS = COMMON["num_hidden_layers"], COMMON["num_key_value_heads"]
octavo = torch.ops.octavo
MAXIMUM = {"int8": 127.0, "fp8": 448.0}
MEAN_SHIFT = {"int8": 1 / 100, "fp8": 1 / 16}


@functools.cache
def quantized_cache(cache_dtype: str, passes: tuple[str, ...] = (*ALL_PASSES, "quantize_kv_cache")) -> Compiled:
    model, traced = traced_model("llama", "float32")
    ctx = PassContext(config=CompileConfig(kv_cache_dtype=cache_dtype), weights=dict(traced.weights),
                      model_config=model.config, architecture=architecture_for(model.config),
                      fake_mode=traced.fake_mode, symbols={"T": traced.num_tokens})
    return Compiled(run_pipeline(clone_graph(traced.graph_module), ctx, list(passes)), ctx)


@pytest.mark.parametrize(("cache_dtype", "torch_dtype"), [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_caches_become_quantized_inputs_with_scale_pools(cache_dtype, torch_dtype):
    after = quantized_cache(cache_dtype)
    layout, inputs = after.ctx.kv_layout, after.ctx.runtime_inputs
    assert layout["cache_dtype"] == str(torch_dtype).removeprefix("torch.") and layout["scale_dtype"] == "float32"
    assert layout["scale_inputs"] == [[f"key_scale_cache_{i}", f"value_scale_cache_{i}"] for i in range(LAYERS)]
    for layer in range(LAYERS):
        assert inputs[f"key_cache_{layer}"]["dtype"] == layout["cache_dtype"]
        assert inputs[f"value_scale_cache_{layer}"] == {"shape": ["num_blocks", 16, KV_HEADS], "dtype": "float32",
                                                        "role": "value_scale_cache"}
    attentions = after.graph_module.graph.find_nodes(op="call_function", target=octavo.paged_attention.default)
    assert [[arg.name for arg in node.args[11:]] for node in attentions] == layout["scale_inputs"]
    assert after.stats("quantize_kv_cache") == {"quantized_layers": LAYERS, "cache_dtype": layout["cache_dtype"]}
    assert after.ctx.quantization == {"scheme": "none", "kv_cache": {"dtype": cache_dtype,
                                                                     "scales": after.ctx.quantization["kv_cache"][
                                                                         "scales"]}}


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_the_cache_holds_each_vector_quantized_with_its_own_scale(cache_dtype):
    quantized = run_steps(quantized_cache(cache_dtype))
    reference = run_steps(compiled("llama", "float32", tuple(ALL_PASSES)))
    names = sorted(name for pair in quantized_cache(cache_dtype).ctx.kv_layout["cache_inputs"] for name in pair)
    pools = dict(zip(sorted([*names, *[n.replace("_cache", "_scale_cache") for n in names]]),
                     quantized[len(quantized) - 2 * len(names):], strict=True))
    float_caches = dict(zip(names, reference[len(reference) - len(names):], strict=True))
    # Layer 0's keys and values depend on the embedding only, so they are the float graph's, quantized as defined:
    # scale = max|x| / M per (token, head), values x / scale rounded (int8) or cast (fp8).
    for name in ("key_cache_0", "value_cache_0"):
        x = float_caches[name]
        written = x.abs().amax(-1) > 0
        scale = torch.where(written, x.abs().amax(-1) / MAXIMUM[cache_dtype], torch.ones_like(written, dtype=float))
        expected = (x / scale.unsqueeze(-1))
        expected = expected.round().to(torch.int8) if cache_dtype == "int8" else expected.to(torch.float8_e4m3fn)
        assert torch.equal(pools[name.replace("_cache", "_scale_cache")][written], scale.float()[written])
        assert torch.equal(pools[name][written].view(torch.int8), expected[written].view(torch.int8))
    # Attention over restored K/V: each element is off by at most half a step, 1/254 of its vector's max (int8) or
    # 1/16 of its own magnitude (fp8: 3 mantissa bits); on average the logits move by about that share of their
    # spread (the random tiny model's layers add up the errors).
    for actual, expected in zip(quantized[:3], reference[:3], strict=True):
        assert (actual - expected).abs().mean() <= MEAN_SHIFT[cache_dtype] * expected.std()


def test_it_runs_after_match_attention_only():
    with pytest.raises(PassError, match="runs after match_attention"):
        quantized_cache("int8", ("canonicalize", "quantize_kv_cache"))
