"""Speculative sampling emits the target's distribution: chi-square tests on a small-vocabulary model.

A 16-token tiny llama samples 12 000 continuations of 4 tokens of one prompt, with temperature,
top-p, a repetition and a presence penalty (the penalties count the proposals accepted earlier in
the same step). The first token comes from the prompt's step; the other three are verified
proposals (k = 2: two proposals and the target's own token per step), from n-gram lookup (point
masses) or from a draft model with other weights (sampled proposals, often rejected). The
reference is the definition applied to Hugging Face's logits of the target: each position's exact
marginal distribution, summed over every possible prefix (16^3 of them).

Power: moving 2% of the probability between the two most likely tokens of a position (the hardest
shift to see) gives a noncentrality 12000 * 0.02^2 * (1/p1 + 1/p2) of 40 to 58 for positions 1-3 of
this model (p1, p2 = 0.32, 0.19 at position 1), which the test at the 1e-3 level (14-15 dof,
critical values 36-38) detects with probability 0.92 to 0.99 (noncentral chi-square).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import run_to_completion
from tests.runtime.sampler_reference import reference_distribution, reference_processed_logits
from tests.runtime.spec_decode.chi_square import SIGNIFICANCE, chi_square
from tests.runtime.spec_decode.small_vocab import VOCAB_SIZE
from tests.runtime.spec_decode.test_speculator import assert_draft_pool_full

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_SAMPLES = 12_000
OUTPUT_LENGTH = 4
PROMPT = "w0 w1 w3 w10 w5 w3 w3 w3 w3 w3"  # the model's own greedy continuation of "w0 w1": proposals it likes
PARAMS = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.3,
              max_tokens=OUTPUT_LENGTH, ignore_eos=True)


@pytest.fixture(scope="module")
def target(small_vocab_artifact):
    return small_vocab_artifact(0)


@pytest.fixture(scope="module")
def marginals(target) -> list[dict[int, float]]:
    """Exact distribution of each output position, by the definitions on Hugging Face's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target.parent / "model", dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(target.parent / "model").encode(PROMPT)
    params = SamplingParams(**PARAMS)
    prefixes = {(): 1.0}
    result = []
    for _ in range(OUTPUT_LENGTH):
        ordered = list(prefixes)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix) for prefix in ordered])).logits[:, -1].double()
        marginal = dict.fromkeys(range(VOCAB_SIZE), 0.0)
        grown = {}
        for prefix, row in zip(ordered, logits.tolist(), strict=True):
            processed = reference_processed_logits(row, params, prompt=prompt, output=list(prefix))
            for token, probability in enumerate(reference_distribution(processed, params)):
                marginal[token] += prefixes[prefix] * probability
                if probability > 0:
                    grown[(*prefix, token)] = prefixes[prefix] * probability
        result.append(marginal)
        prefixes = grown
    return result


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_samples_follow_the_target_distribution(target, small_vocab_artifact, marginals, proposer):
    speculative = "ngram:2:fixed:n=1-3" if proposer == "ngram" else f"draft:{small_vocab_artifact(1)}:2:fixed"
    # Separate requests, not n samples of one: the engine's per-step work then stays per scheduled sequence.
    engine = LLMEngine(target, EngineConfig(speculative=speculative, max_num_seqs=512,
                                            max_num_batched_tokens=8192, num_kv_blocks=600, seed=7))
    for index in range(NUM_SAMPLES):
        engine.add_request(PROMPT, SamplingParams(**PARAMS), request_id=str(index))
    samples = [output.outputs[0].token_ids for output in run_to_completion(engine).values()]
    assert_pool_full(engine)
    assert_draft_pool_full(engine)
    assert len(samples) == NUM_SAMPLES and all(len(sample) == OUTPUT_LENGTH for sample in samples)
    metrics = engine.get_metrics().speculative
    # Most samples verified proposals; many were accepted and many rejected.
    assert metrics.num_verifications >= NUM_SAMPLES // 2
    assert metrics.accepted_tokens >= NUM_SAMPLES // 20
    assert metrics.proposed_tokens - metrics.accepted_tokens >= NUM_SAMPLES // 20
    for position, marginal in enumerate(marginals):
        result = chi_square(Counter(sample[position] for sample in samples), marginal)
        print(f"{proposer} position {position}: {result}")
        assert result.p_value > SIGNIFICANCE, f"{proposer} position {position}: {result}"
