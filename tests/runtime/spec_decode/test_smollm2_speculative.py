"""Speculative decoding on the real model: SmolLM2 fp32, greedy, batched, with prefix caching and preemption.

Eight chat prompts (some ask to repeat or edit given text, so n-gram proposals are often right;
others do not; all share the template's system prompt, so the prefix cache is hit) run together.
Their greedy tokens with speculation, in a pool so small that sequences are preempted (by recompute
with n-gram proposals, by swap with a draft model: the artifact itself, a draft that agrees), must
equal the tokens without speculation in a pool that holds them all.
"""

from __future__ import annotations

import pytest

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, run_to_completion
from tests.runtime.spec_decode.test_speculator import assert_draft_pool_full

MAX_TOKENS = 24
QUESTIONS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Copy this list and add a fourth item: apples, oranges, bananas.",
    "What is the capital of France?",
    "Rewrite in uppercase: speculative decoding verifies several tokens in one step.",
    "Write a haiku about compilers.",
    "Repeat after me: one, two, three, four, five, six, seven, eight, nine, ten.",
    "Give me three tips for writing readable Python code.",
    "Translate to French: good morning, how are you today?",
]
pytestmark = pytest.mark.usefixtures("one_thread")  # robust to a loaded machine; speed is not tested here

SMALL_POOL = {"num_kv_blocks": 20, "max_num_batched_tokens": 256}  # the 8 requests need about 40 blocks


@pytest.fixture(scope="module")
def smollm2(smollm2_fp32_artifact):
    return load_artifact(smollm2_fp32_artifact)


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tokenizer = smollm2.tokenizer
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                           add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False) for question in QUESTIONS]


def generate(artifact, prompts, speculative=None, **options):
    engine = LLMEngine(artifact, EngineConfig(speculative=speculative, **options))
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(MAX_TOKENS), request_id=str(index))
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    assert_draft_pool_full(engine)
    return [finals[str(index)].outputs[0].token_ids for index in range(len(prompts))], engine


def test_greedy_tokens_equal_plain_decoding(smollm2, prompts):
    plain, _ = generate(smollm2, prompts, num_kv_blocks=128)
    for speculative, mode in (("ngram:4:fixed", "recompute"), (f"draft:{smollm2.path}:2:fixed", "swap")):
        tokens, engine = generate(smollm2, prompts, speculative, preemption_mode=mode, swap_space="64MiB",
                                  **SMALL_POOL)
        assert tokens == plain, speculative
        assert engine.scheduler.preemptions[mode] > 0, speculative
        assert engine.block_manager.stats.hit_tokens > 0, speculative
        metrics = engine.get_metrics().speculative
        assert 0 < metrics.accepted_tokens <= metrics.proposed_tokens, speculative
