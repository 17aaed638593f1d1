"""Quantized SmolLM2 artifacts: GGUF's exact values, sizes, perplexity bounds against fp32, coherent answers.

The bundled model is a Q4_1 GGUF whose token embedding is Q8_0, so the fp32 artifact holds
exactly the dequantized GGUF values: `--quant w4` keeps the Q4_1 blocks and the Q8_0 table
as they are, `--quant w8` requantizes the linears to int8 per channel (and keeps the Q8_0
table). Perplexity is scored on a short slice of the evaluation text, the same tokens for
every artifact; the bounds are the project's targets (w8 within +1% of fp32, an int8 KV
cache within +0.5%; w8a8, whose activations are also rounded to int8 in groups of 64, is held to w8's +1%: on
this slice it measured -0.35% against w8's -0.33%, on 2048 tokens of held-out prose, code and documentation
+0.7%, +0.4% and +0.0%, benchmarks/RESULTS.md) and, for w4 (GGUF's own values, computed with bf16 activations where
the CPU has native bf16), +1%; for w4 with a 4-bit vocabulary table, the +6% the project
allows calibrated 4-bit schemes.

At group size 64 the GGUF values are not kept: round to nearest (w4), AWQ and GPTQ (act-order) each quantize the float
weights, AWQ and GPTQ calibrated on the first CALIBRATION_CHARS characters (tests/smollm2_quantized.py) of the default
calibration mix (9 runs of 512 tokens instead of 32, so that the suite can afford two calibrated compiles). Their
bounds come from benchmarks/RESULTS.md ("The suite's calibrated schemes"), which measured this exact configuration and
slice on two GEMM paths of one CPU: RTN +26.1%, AWQ +5.9%, GPTQ +4.8% over fp32 on AMX tiles, +25.8%, +6.0%, +5.0% on
oneDNN's bfloat16 GEMM. Each bound adds 1.5 points to the larger rise, the margin the arithmetic needs: the quantized
kernels round activations to bfloat16 only where the CPU computes it natively (the w4 variant's 1% bound above is that
effect alone), and the calibration statistics come from a float model whose rounding differs across CPUs. RTN is also
held from below (a rise under 20% would mean the weights were not re-quantized), and each calibrated scheme must keep
its rise under a third of RTN's: what calibrating buys.

The artifacts (fp32 among them) and their perplexities come from tests/smollm2_quantized.py, which the session
runs in the background while other tests run (tests/background_builds.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from octavo.config import EngineConfig
from octavo.ir.quantized_layout import QuantizedWeight
from octavo.runtime.engine import LLMEngine
from octavo.runtime.weights import load_safetensors_mmap
from tests.smollm2_quantized import PERPLEXITIES, SLICE_TOKENS, VARIANTS

pytestmark = pytest.mark.slow
CALIBRATED_RUNS = 9
# Measured rise over fp32 (RESULTS.md), and the bound's margin (module docstring).
MEASURED_RISE = {"w4-g64": 0.261, "w4-awq-g64": 0.060, "w4-gptq-g64": 0.050}
ARITHMETIC_MARGIN = 0.015


@pytest.fixture(scope="module")
def artifacts(smollm2_quantized) -> dict[str, Path]:
    """Every variant's artifact (tests/smollm2_quantized.py, built beside the session's other tests)."""
    return {name: smollm2_quantized / name for name in VARIANTS}


@pytest.fixture(scope="module")
def perplexities(smollm2_quantized) -> dict[str, float]:
    results = json.loads((smollm2_quantized / PERPLEXITIES).read_text())
    assert set(results) == set(VARIANTS)
    assert all(result["tokens_scored"] == SLICE_TOKENS - 1 for result in results.values()), results
    assert len({result["tokens_sha256"] for result in results.values()}) == 1
    return {name: result["perplexity"] for name, result in results.items()}


# w4-vocab4 also stores the embedding/lm_head in 4 bits: held to the calibrated schemes' +6%.
@pytest.mark.parametrize(("variant", "bound"), [("w8", 0.01), ("w8a8", 0.01), ("w4", 0.01), ("w4-vocab4", 0.06),
                                                ("kv-int8", 0.005)])
def test_perplexity_within_bounds_of_fp32(perplexities, variant, bound):
    assert 5 < perplexities["fp32"] < 30, f"fp32 perplexity {perplexities['fp32']} is not a working model's"
    assert perplexities[variant] <= perplexities["fp32"] * (1 + bound), perplexities


def rise(perplexities: dict[str, float], variant: str) -> float:
    return perplexities[variant] / perplexities["fp32"] - 1


@pytest.mark.parametrize("variant", ["w4-g64", "w4-awq-g64", "w4-gptq-g64"])
def test_group_64_schemes_within_their_measured_perplexity(perplexities, variant):
    assert rise(perplexities, variant) <= MEASURED_RISE[variant] + ARITHMETIC_MARGIN, perplexities
    if variant == "w4-g64":
        assert rise(perplexities, variant) >= 0.20, perplexities
    else:
        assert rise(perplexities, variant) <= rise(perplexities, "w4-g64") / 3, perplexities


@pytest.mark.parametrize(("variant", "scheme", "values"), [("w4-g64", "w4", "rtn"), ("w4-awq-g64", "w4-awq", "awq"),
                                                           ("w4-gptq-g64", "w4-gptq", "gptq")])
def test_group_64_schemes_quantize_every_linear_their_way(artifacts, variant, scheme, values):
    """Every linear of the 30 layers is quantized by the scheme at group size 64 (no GGUF value kept), calibrated
    schemes on the 9 runs of the calibration file."""
    record = LLMEngine(artifacts[variant], EngineConfig(num_kv_blocks=4)).artifact.manifest["quantization"]
    assert (record["scheme"], record["group_size"]) == (scheme, 64)
    assert record["values"] == {values: 4 * 30, "gguf Q8_0": 1}
    if scheme != "w4":
        assert (record["calibration"]["runs"], record["calibration"]["tokens_used"]) == (CALIBRATED_RUNS, 9 * 512)
    if scheme == "w4-gptq":
        assert record["gptq"]["act_order"] is True


def test_w4_keeps_the_gguf_values_exactly(artifacts):
    manifest = LLMEngine(artifacts["w4"], EngineConfig(num_kv_blocks=4)).artifact.manifest
    record = manifest["quantization"]
    assert record["values"] == {"gguf Q4_1": 4 * 30, "gguf Q8_0": 1}  # qkv, o, gate_up, down per layer; the table
    quantized = load_safetensors_mmap(artifacts["w4"] / "weights.safetensors")
    floats = load_safetensors_mmap(artifacts["fp32"] / "weights.safetensors")
    for base, layout in [("model_layers_0_self_attn_qkv_proj", "w4"), ("model_layers_17_mlp_down_proj", "w4"),
                         ("model_embed_tokens", "w8")]:
        weight = QuantizedWeight(layout, quantized[f"{base}_qweight"], quantized[f"{base}_scales"],
                                 quantized.get(f"{base}_offsets"), 32)
        # transformers' float weights (the fp32 artifact's) are GGUF's dequantization: the same bits.
        assert torch.equal(weight.dequantize().view(torch.int32), floats[f"{base}_weight"].view(torch.int32))


def test_weights_on_disk(artifacts):
    sizes = {name: (path / "weights.safetensors").stat().st_size for name, path in artifacts.items()}
    bf16 = sizes["fp32"] / 2  # every fp32 artifact weight is a float tensor: bf16 stores half the bytes
    assert sizes["w8"] <= 0.55 * bf16, sizes
    # The default w4 keeps the int8 vocabulary table (0.37x here); with a 4-bit table it meets 0.35x.
    assert sizes["w4-vocab4"] <= 0.35 * bf16, sizes


NEAR_TIE_NATS = 0.1
"""Where the CPU has native bf16, the quantized kernels round activations to bf16 (relative error
2^-8 per element); through 30 layers that moves a logit by a few hundredths of a nat (0.05 measured
on the first answer token below), so two tokens whose log-probabilities are closer than 0.1 nat may
trade places. Such a flip is rounding, not an incoherent model."""

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in two sentences what a compiler does."]
ANSWER_TOKENS = 24


def test_w4_tokens_are_hf_argmax_on_the_same_weights_or_a_near_tie(artifacts, smollm2_source, smollm2_hf_fp32):
    """w4 at group 32 holds the GGUF's own values, which are HF's float32 weights: its greedy tokens are HF's
    argmax under teacher forcing, or a near tie within the bfloat16 model's margin (tests/test_smollm2.py's
    BF16_TIE_MARGIN, 2^-5 of the top logit). That margin bounds this artifact too: its kernels round only the
    activations of the GEMMs above 8 rows to bfloat16 (where the CPU has it natively), a subset of the
    roundings of a bfloat16 model, and the decode GEMV is float32."""
    from octavo.llm import LLM
    from octavo.runtime.sampling_params import SamplingParams
    from tests.test_smollm2 import BF16_TIE_MARGIN, MAX_RUNNER_UP_WITHIN_MARGIN
    from tests.token_agreement import check_near_ties

    tokenizer = smollm2_source.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for question in QUESTIONS]
    llm = LLM(artifacts["w4"], num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    outputs = [output.outputs[0].token_ids for output in llm.generate([{"prompt_token_ids": prompt}
                                                                       for prompt in prompts], greedy)]
    assert all(len(tokens) == ANSWER_TOKENS for tokens in outputs)
    check_near_ties(smollm2_hf_fp32, prompts, outputs, BF16_TIE_MARGIN, MAX_RUNNER_UP_WITHIN_MARGIN)


def test_w8_answers_coherently(artifacts):
    """w8 requantizes the GGUF values per channel, so no HF model holds its weights: its greedy answer names Paris;
    where its first token differs from the fp32 artifact's by a near tie, the answer that continues from the fp32
    artifact's first token names Paris."""
    from octavo.llm import LLM
    from octavo.runtime.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    reference = LLM(artifacts["fp32"], num_kv_blocks=64)
    prompt = reference.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    first = reference.generate([prompt], greedy)[0].outputs[0].token_ids[0]
    llm = LLM(artifacts["w8"], num_kv_blocks=64)
    output = llm.generate([prompt], greedy)[0].outputs[0]
    if output.token_ids[0] != first:
        options = output.logprobs[0]
        assert first in options, (output.text, "the fp32 first token is not in the top 5")
        gap = options[output.token_ids[0]].logprob - options[first].logprob
        assert gap <= NEAR_TIE_NATS, (output.text, gap)
        forced = {"prompt_token_ids": [*prompt, first]}
        output = llm.generate([forced], greedy)[0].outputs[0]
    assert "Paris" in output.text, output.text
