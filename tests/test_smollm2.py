"""The bundled SmolLM2-135M (real weights): Octavo's tokens equal Hugging Face's."""

from __future__ import annotations

import copy

import pytest
import torch

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full

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


def test_bf16_tokens_are_top5_under_teacher_forcing(smollm2_bf16_artifact, smollm2_hf_bf16, prompts):
    hf_bf16 = smollm2_hf_bf16
    llm = LLM(smollm2_bf16_artifact, num_kv_blocks=512)
    tokens = octavo_greedy(llm, prompts, NEW_TOKENS)
    for index, (prompt, ours) in enumerate(zip(prompts, tokens, strict=True)):
        sequence = torch.tensor([prompt + ours])
        with torch.no_grad():
            logits = hf_bf16(sequence).logits[0, len(prompt) - 1:-1].float()
        top5 = logits.topk(5, dim=-1).indices
        in_top5 = (top5 == torch.tensor(ours).unsqueeze(1)).any(dim=1)
        outside = (~in_top5).nonzero().flatten().tolist()
        assert not outside, f"prompt {index}: tokens outside HF's top 5 at output positions {outside}"
        assert ours[:16] == hf_greedy(hf_bf16, prompt, 16), f"prompt {index}: first 16 tokens differ"
    assert_pool_full(llm.engine)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
