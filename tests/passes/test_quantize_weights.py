"""quantize_weights: linears, the embedding and lm_head rewritten to octavo quantized ops over quantized weights."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from octavo.config import CompileConfig
from octavo.errors import OctavoError, PassError
from octavo.frontend.architectures import architecture_for
from octavo.ir.quantized_layout import W4, W8, QuantizedWeight
from octavo.passes import PassContext, quant_schemes, run_pipeline
from octavo.passes.quant_schemes import VOCAB_REASONS
from octavo.passes.quantize_rtn import quantize_w4, quantize_w8
from tests.passes.fusion_harness import (
    ALL_PASSES,
    Compiled,
    assert_bitwise_equal,
    clone_graph,
    compiled,
    run_steps,
    traced_model,
)
from tests.tiny_models import COMMON

LAYERS = COMMON["num_hidden_layers"]
PASSES = (*ALL_PASSES, "quantize_weights")


def quantized(model_type: str, provided: dict | None = None, **options) -> Compiled:
    """The default pipeline plus quantize_weights on a fresh copy of the traced tiny model."""
    model, traced = traced_model(model_type, "float32")
    ctx = PassContext(config=CompileConfig(**options), weights=dict(traced.weights), model_config=model.config,
                      architecture=architecture_for(model.config), fake_mode=traced.fake_mode,
                      symbols={"T": traced.num_tokens}, provided_weights=provided or {})
    return Compiled(run_pipeline(clone_graph(traced.graph_module), ctx, list(PASSES)), ctx)


cached_quantized = functools.cache(quantized)


def stored(compiled: Compiled, base: str) -> QuantizedWeight:
    """The QuantizedWeight the pass stored for weight `<base>_weight`, read back from the weights."""
    weights = compiled.ctx.weights
    record = {entry["weight"]: entry for entry in (compiled.ctx.quantization["vocab"] or {}).get("weights", [])}
    layout = record.get(f"{base}_weight", {}).get("layout") or compiled.ctx.quantization["layout"]
    group = record.get(f"{base}_weight", {}).get("group_size") or compiled.ctx.quantization["group_size"]
    qweight = weights[f"{base}_qweight"]
    return QuantizedWeight(layout, qweight, weights[f"{base}_scales"], weights.get(f"{base}_offsets"),
                           group or qweight.shape[1])


# llama: untied embedding and lm_head; qwen2: tied, and qkv biases. Each vocab layout once.
VARIANTS = [("llama", "w8", "int8"), ("qwen2", "w4", "w4"), ("llama", "fp8", "none")]
PER_LAYER = 4  # qkv, o, gate_up, down


@pytest.mark.parametrize(("model_type", "quant", "vocab"), VARIANTS)
def test_every_linear_and_the_embedding_are_rewritten(model_type, quant, vocab):
    after = cached_quantized(model_type, quant=quant, vocab_quant=vocab)
    vocab_op = {"int8": "w8", "w4": "w4", "none": None}[vocab]
    histogram = {op: count for op, count in after.histogram().items()
                 if op.startswith(("octavo.linear", "octavo.embedding", "aten.linear", "aten.embedding"))}
    expected = {f"octavo.linear_{quant}": PER_LAYER * LAYERS}
    if vocab_op:
        expected[f"octavo.linear_{vocab_op}"] = expected.get(f"octavo.linear_{vocab_op}", 0) + 1
        expected[f"octavo.embedding_{vocab_op}"] = 1
    else:
        expected.update({"aten.linear": 1, "aten.embedding": 1})
    assert histogram == expected
    tied = model_type == "qwen2"
    stats = after.stats("quantize_weights")
    assert stats["quantized_linears"] == PER_LAYER * LAYERS and stats["provided"] == 0
    assert stats["quantized_vocab"] == (0 if vocab == "none" else 1 if tied else 2)
    # The tiny models' vocabulary tables hold almost all their bytes.
    assert stats["bytes_after"] < stats["bytes_before"] / (3 if vocab_op else 1)
    record = after.ctx.quantization
    if vocab_op:
        assert [entry["tied"] for entry in record["vocab"]["weights"]] == ([True] if tied else [False, False])
        assert not any(name.endswith("proj_weight") or name == "lm_head_weight" for name in after.ctx.weights)
    else:
        assert record["vocab"] is None
        assert {"weights": ["model_embed_tokens_weight", "lm_head_weight"], "reason": VOCAB_REASONS["none"]} in (
            record["left_unquantized"])
    if tied:
        assert after.ctx.weights["model_layers_0_self_attn_qkv_proj_bias"].dtype == torch.float32  # bias kept


@pytest.mark.parametrize(("model_type", "quant", "vocab"), VARIANTS)
def test_outputs_equal_the_float_graph_on_the_dequantized_weights(model_type, quant, vocab):
    after = cached_quantized(model_type, quant=quant, vocab_quant=vocab)
    before = compiled(model_type, "float32", tuple(ALL_PASSES))
    dequantized = {name: stored(after, name.removesuffix("_weight")).dequantize()
                   if f"{name.removesuffix('_weight')}_qweight" in after.ctx.weights else tensor
                   for name, tensor in before.ctx.weights.items()}
    # The quantized ops' definitions are the float ops on the dequantized weights: the same float32 arithmetic.
    assert_bitwise_equal(run_steps(after), run_steps(before, weights=dequantized))


def test_provided_values_are_stored_as_they_are_and_fused_parts_concatenated():
    _, traced = traced_model("llama", "float32")
    prefix = "model_layers_0_self_attn_"
    supplied = {f"{prefix}{name}_weight": _supplied(traced.weights[f"{prefix}{name}_weight"])
                for name in ("q_proj", "k_proj", "v_proj")}
    supplied["model_layers_1_self_attn_q_proj_weight"] = _supplied(
        traced.weights["model_layers_1_self_attn_q_proj_weight"])  # layer 1: k and v are not supplied
    after = quantized("llama", supplied, quant="w4")
    fused = stored(after, f"{prefix}qkv_proj")
    for role in ("qweight", "scales", "offsets"):
        expected = torch.cat([getattr(supplied[f"{prefix}{name}_weight"], role) for name in ("q_proj", "k_proj",
                                                                                          "v_proj")])
        assert torch.equal(fused.tensors()[role], expected)
    assert after.ctx.quantization["values"] == {"rtn": 9, "test": 1}  # 8 linears, embedding, lm_head
    assert after.stats("quantize_weights")["provided"] == 1


def test_an_explicit_other_group_size_quantizes_again():
    _, traced = traced_model("llama", "float32")
    name = "model_layers_0_mlp_down_proj_weight"
    after = quantized("llama", {name: _supplied(traced.weights[name])}, quant="w4", group_size=64)
    assert stored(after, "model_layers_0_mlp_down_proj").group_size == 64
    assert after.ctx.quantization["values"] == {"rtn": 10}


def test_w8a8_stores_w8_per_channel_and_records_int8_activations():
    """w8a8's linears are w8 with one scale per output channel even where grouped int8 values are supplied (GGUF's
    Q8_0); the manifest's record says the runtime rounds the activations to int8; a group size is refused."""
    _, traced = traced_model("llama", "float32")
    name = "model_layers_0_mlp_down_proj_weight"
    supplied = quantize_w8(traced.weights[name], 32)
    after = quantized("llama", {name: QuantizedWeight(W8, supplied.qweight, supplied.scales, None, 32, "test")},
                      quant="w8a8")
    down = stored(after, "model_layers_0_mlp_down_proj")
    assert down.layout == W8 and down.group_size == traced.weights[name].shape[1]
    assert after.ctx.quantization["scheme"] == "w8a8" and after.ctx.quantization["group_size"] is None
    assert after.ctx.quantization["activations"]["dtype"] == "int8"
    assert "test" not in after.ctx.quantization["values"]
    with pytest.raises(OctavoError, match="--quant w8a8 takes one scale per output channel"):
        CompileConfig(quant="w8a8", group_size=32)


def _supplied(weight: torch.Tensor) -> QuantizedWeight:
    # Values no RTN of this weight would produce: a scale twice the range's, so tests can tell them apart.
    value = quantize_w4(weight, 32)
    return QuantizedWeight(W4, value.qweight, value.scales * 2, value.offsets, 32, "test")


def test_a_registered_scheme_prepares_weights_and_supplies_its_own_values(monkeypatch):
    calls = []

    class FoldingScheme(quant_schemes.QuantScheme):
        """Like AWQ's shape: scale one norm's weight down and the linears reading it up (same function)."""

        def prepare(self, graph_module, ctx):
            norm, qkv = "model_layers_0_input_layernorm_weight", "model_layers_0_self_attn_qkv_proj_weight"
            ctx.weights[norm] = ctx.weights[norm] / 2
            ctx.weights[qkv] = ctx.weights[qkv] * 2
            calls.append("prepare")

        def quantize_linear(self, name, weight, ctx):
            calls.append(name)
            return QuantizedWeight(W4, *quantize_w4(weight, 32).tensors().values(), 32, "folded")

    monkeypatch.setitem(quant_schemes.SCHEMES, "w4-awq",
                        lambda config: FoldingScheme("w4-awq", W4, 32, calibrated=True))
    after = quantized("llama", quant="w4-awq")
    _, traced = traced_model("llama", "float32")
    assert calls[0] == "prepare" and len(calls) == 1 + 4 * LAYERS
    assert torch.equal(after.ctx.weights["model_layers_0_input_layernorm_weight"],
                       traced.weights["model_layers_0_input_layernorm_weight"] / 2)
    qkv = stored(after, "model_layers_0_self_attn_qkv_proj")
    assert torch.equal(qkv.dequantize(), quantize_w4(_fused_qkv(traced.weights, 0) * 2, 32).dequantize())
    assert after.ctx.quantization["values"] == {"folded": 8, "rtn": 2}
    assert after.ctx.quantization["calibrated"] is True


def _fused_qkv(weights: dict, layer: int) -> torch.Tensor:
    prefix = f"model_layers_{layer}_self_attn_"
    return torch.cat([weights[f"{prefix}{name}_weight"] for name in ("q_proj", "k_proj", "v_proj")])


def _linear_chain(weights: dict[str, torch.Tensor], quant: str) -> tuple[torch.fx.GraphModule, PassContext]:
    """x -> aten.linear by each weight in turn, with fake metadata and a context, as the manager keeps them."""
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    nodes = {name: graph.placeholder(name) for name in weights}
    for node in nodes.values():
        value = graph.call_function(torch.ops.aten.linear.default, (value, node))
    graph.output(value)
    graph_module = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode()
    first = next(iter(weights.values()))
    FakeTensorProp(graph_module, mode).propagate(torch.randn(3, first.shape[1]), *weights.values())
    ctx = PassContext(config=CompileConfig(quant=quant), weights=dict(weights), model_config=None, architecture=None,
                      fake_mode=mode, symbols={})
    return graph_module, ctx


def test_odd_input_features_stay_float_for_w4_with_the_reason():
    weights = {"first_weight": torch.randn(64, 63), "second_weight": torch.randn(32, 64),
               "third_weight": torch.randn(16, 32)}
    graph_module, ctx = _linear_chain(weights, "w4")
    run_pipeline(graph_module, ctx, ["quantize_weights"])
    left = {entry["reason"]: entry["weights"] for entry in ctx.quantization["left_unquantized"]}
    assert left["w4 needs an even number of input features"] == ["first_weight"]
    assert "first_weight" in ctx.weights and "second_qweight" in ctx.weights
    assert ctx.quantization["vocab"]["weights"][0]["weight"] == "third_weight"  # the last linear: the lm_head


def test_a_graph_whose_only_linear_is_the_lm_head_is_an_error():
    graph_module, ctx = _linear_chain({"head_weight": torch.randn(8, 16)}, "w8")
    with pytest.raises(PassError, match="found no linear"):
        run_pipeline(graph_module, ctx, ["quantize_weights"])


def test_a_calibrated_scheme_gets_the_calibration_tokens_and_the_manifest_names_them(
        monkeypatch, tiny_model_dir, tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    from octavo.compiler import compile_model
    from octavo.runtime.loader import read_manifest

    seen = []

    class Calibrated(quant_schemes.QuantScheme):
        def prepare(self, graph_module, ctx):
            seen.append(ctx.calibration)

    monkeypatch.setitem(quant_schemes.SCHEMES, "w4-gptq", lambda config: Calibrated("w4-gptq", W4, 32,
                                                                                    calibrated=True))
    text = tmp_path / "calibration.jsonl"
    text.write_text('{"text": "Calibration text for a test."}\n{"text": "A second record."}\n')
    artifact = compile_model(tiny_model_dir("llama"), tmp_path / "artifact",
                             CompileConfig(dtype="float32", quant="w4-gptq", calibration=str(text)))
    expected = AutoTokenizer.from_pretrained(tokenizer_dir).encode(
        "Calibration text for a test.\n\nA second record.", add_special_tokens=False)
    assert seen[0].token_ids == expected and seen[0].samples(4, 2) == [expected[:4], expected[4:8]]
    record = read_manifest(artifact)["quantization"]["calibration"]
    assert record["source"] == str(text) and record["tokens"] == len(expected) and len(record["sha256"]) == 64
