"""SmolLM2-135M (9 query heads, 3 KV heads) on 3 tensor-parallel ranks, through the public LLM API.

Each rank holds 3 query heads and 1 KV head. In float32 the ranks' partial
sums differ from the single process's sums only by rounding (~1e-6 on the
logits), far below the gaps between the top tokens of real text, so greedy
decoding must give the same tokens.
"""

from __future__ import annotations

import pytest

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about compilers.",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, the first person to walk on the moon was",
    "A good way to learn a new language is",
    "Water boils at a temperature of",
    "The best thing about open source software is",
]


def test_three_ranks_generate_the_single_process_greedy_tokens(smollm2_fp32_artifact):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    single = LLM(smollm2_fp32_artifact, num_kv_blocks=256, num_threads=1)
    expected = [output.outputs[0].token_ids for output in single.generate(PROMPTS, params)]
    parallel = LLM(smollm2_fp32_artifact, num_kv_blocks=256, num_threads=1, tensor_parallel_size=3)
    try:
        assert parallel.engine.kv_cache.layout["num_kv_heads"] == 1
        assert [output.outputs[0].token_ids for output in parallel.generate(PROMPTS, params)] == expected
    finally:
        parallel.shutdown()
