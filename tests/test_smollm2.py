"""The bundled SmolLM2-135M (real weights): Octavo's tokens equal Hugging Face's."""

from __future__ import annotations

import copy

import pytest
import torch

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.token_agreement import check_near_ties

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "What is 17 multiplied by 23?",
    "Describe a cat to someone who has never seen one.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(smollm2_source) -> list[list[int]]:
    tokenizer = smollm2_source.tokenizer
    return [tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for question in QUESTIONS]


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """HF generate, greedy, running the full `num_tokens` even past EOS (no EOS masking either)."""
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return output[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_fp32_tokens(smollm2_hf_fp32, prompts) -> list[list[int]]:
    return [hf_greedy(smollm2_hf_fp32, prompt, NEW_TOKENS) for prompt in prompts]


def octavo_greedy(llm: LLM, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert all(output.error is None for output in outputs)
    return [output.outputs[0].token_ids for output in outputs]


def test_fp32_greedy_equals_hf_generate_batched(smollm2_fp32_artifact, prompts, hf_fp32_tokens):
    llm = LLM(smollm2_fp32_artifact, num_kv_blocks=512)
    tokens = octavo_greedy(llm, prompts, NEW_TOKENS)
    for index, (ours, theirs) in enumerate(zip(tokens, hf_fp32_tokens, strict=True)):
        assert ours == theirs, f"prompt {index}: first difference at token {_first_difference(ours, theirs)}"
    assert_pool_full(llm.engine)


def test_fp32_greedy_equals_hf_generate_with_chunked_prefill(smollm2_fp32_artifact, prompts, hf_fp32_tokens):
    llm = LLM(smollm2_fp32_artifact, num_kv_blocks=512, max_num_batched_tokens=24)
    longest = max(map(len, prompts))
    assert longest > 24, "the budget must be smaller than the prompts to force chunking"
    tokens = octavo_greedy(llm, prompts, NEW_TOKENS)
    assert tokens == hf_fp32_tokens
    assert_pool_full(llm.engine)


# The bf16 near-tie margin, a fraction of the top logit: 2^-5 ~ 1.5 * sqrt(30 layers) * 2^-8 (bf16's
# relative rounding); see the test's docstring.
BF16_TIE_MARGIN = 2.0**-5
# At most this share of positions may have HF's own runner-up within the margin (measured: 0.30).
MAX_RUNNER_UP_WITHIN_MARGIN = 0.4


def test_bf16_tokens_are_hf_argmax_or_a_near_tie_and_in_hf_top5(smollm2_bf16_artifact, smollm2_hf_bf16, prompts):
    """Octavo's bf16 greedy tokens against HF's bf16 logits under teacher forcing (HF fed Octavo's tokens).

    Every token must be in HF's top 5, and where it is not HF's argmax, HF's logits for the two tokens
    must be a near tie: top - chosen <= BF16_TIE_MARGIN * |top|.

    Why that margin. Octavo runs HF's op sequence (the fusion passes keep the torch backend's results
    bit for bit), so its bf16 logits differ from HF's only through the kernels that differ: attention
    (paged, batched by step, vs SDPA over the whole sequence) and the GEMMs, whose fp32 accumulation
    order depends on the batch shape and on the CPU (AVX-512 BF16, AMX, or AVX2 emulation). Each rounds
    its output to bf16 once, so where the two accumulations straddle a rounding boundary the outputs
    differ by one rounding, at most u = 2^-8 relative. With (at most) one such differently rounded
    output on the residual stream per layer, independent across the 30 layers, the last hidden state,
    and with it the difference between two logits near the top, moves by about sqrt(30) * u = 2.1% of
    the top logit; 2^-5 = 3.1% leaves 1.5x for the tails. (The final rounding of the logits themselves,
    one bf16 spacing = 2^-8 to 2^-7 of |top|, lies inside it.) Measured on 8 prompts x 64 tokens: the
    tokens that differ from HF's argmax are 0.46-0.70% of |top| below it with AVX-512, at most 1.7%
    with the CPU forced down to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2).

    Why it is not loose: HF's top-1/top-2 gap has a median of 1.5 logits, about twice the median margin
    (0.76); HF's own runner-up lies within the margin at only 30% of the positions, so a model that
    differs from HF by more than rounding fails at the first such token. The test checks that share too
    (MAX_RUNNER_UP_WITHIN_MARGIN), so the margin cannot silently grow loose.
    """
    llm = LLM(smollm2_bf16_artifact, num_kv_blocks=512)
    tokens = octavo_greedy(llm, prompts, NEW_TOKENS)
    check_near_ties(smollm2_hf_bf16, prompts, tokens, BF16_TIE_MARGIN, MAX_RUNNER_UP_WITHIN_MARGIN)
    assert_pool_full(llm.engine)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
