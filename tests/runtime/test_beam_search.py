"""Beam search (LLM.beam_search) against a straightforward reference over Hugging Face logits.

The reference is vLLM's LLM.beam_search algorithm written out plainly: each
round every live beam proposes its 2 * beam_width most likely next tokens
(raw log-softmax of HF eager fp32 logits over the beam's whole sequence);
candidates ending in EOS become completed hypotheses unless ignore_eos; the
best beam_width others by cum_logprob / len ** length_penalty (len counts
the prompt, not a final EOS) are kept; at the end the best beam_width of
completed + live are returned, best first.
"""

from __future__ import annotations

import random

import pytest
import torch

from octavo.llm import LLM
from octavo.runtime.beam_search import BeamSearchParams, beam_search
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import make_engine

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 49000) for _ in range(length)] for length in (21, 40)]


def score(tokens: list[int], cum_logprob: float, eos: set[int], length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens[-1] in eos else 0)
    return cum_logprob / length ** length_penalty


class ReferenceBeamSearch:
    """vLLM's beam search over HF logits, one full forward per beam and round (memoized)."""

    def __init__(self, model):
        self.model = model
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def next_logprobs(self, tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in self.cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([tokens])).logits[0, -1]
            self.cache[key] = torch.log_softmax(logits.float(), dim=-1)
        return self.cache[key]

    def run(self, prompt: list[int], beam_width: int, max_tokens: int, eos: set[int], ignore_eos: bool = False,
            length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
        def key(beam):
            return score(beam[0], beam[1], eos, length_penalty)

        beams = [(list(prompt), 0.0)]
        completed = []
        for _ in range(max_tokens):
            candidates = []
            for tokens, cum_logprob in beams:
                values, token_ids = self.next_logprobs(tokens).topk(2 * beam_width)
                for value, token in zip(values.tolist(), token_ids.tolist(), strict=True):
                    candidate = ([*tokens, token], cum_logprob + value)
                    if token in eos and not ignore_eos:
                        completed.append(candidate)
                    else:
                        candidates.append(candidate)
            beams = sorted(candidates, key=key, reverse=True)[:beam_width]
        return sorted(completed + beams, key=key, reverse=True)[:beam_width]


@pytest.fixture(scope="module")
def reference(hf_model) -> ReferenceBeamSearch:
    return ReferenceBeamSearch(hf_model)


def assert_matches(outputs, expected_per_prompt) -> None:
    assert len(outputs) == len(expected_per_prompt)
    for output, expected in zip(outputs, expected_per_prompt, strict=True):
        assert [hypothesis.tokens for hypothesis in output.sequences] == [tokens for tokens, _ in expected]
        for hypothesis, (_, cum_logprob) in zip(output.sequences, expected, strict=True):
            assert abs(hypothesis.cum_logprob - cum_logprob) <= TOLERANCE


@pytest.mark.parametrize("length_penalty", [1.0, 0.3])
def test_llm_beam_search_equals_the_reference(tiny_artifact, reference, prompts, length_penalty):
    llm = LLM(tiny_artifact("llama"), num_kv_blocks=64, max_num_batched_tokens=32)
    eos = set(llm.engine.eos_token_ids)
    outputs = llm.beam_search(prompts, beam_width=3, max_tokens=6, length_penalty=length_penalty)
    assert_matches(outputs, [reference.run(prompt, 3, 6, eos, length_penalty=length_penalty) for prompt in prompts])
    assert all(len(hypothesis.tokens) == len(prompt) + 6
               for output, prompt in zip(outputs, prompts, strict=True) for hypothesis in output.sequences)
    text = llm.tokenizer.decode(outputs[0].sequences[0].tokens[len(prompts[0]):], skip_special_tokens=True)
    assert outputs[0].sequences[0].text == text
    assert_pool_full(llm.engine)


def test_eos_candidates_become_completed_hypotheses(artifact, reference, prompts):
    """With a token the model proposes often declared EOS, hypotheses end early, as the reference says."""
    plain = reference.run(prompts[0], 3, 5, eos=set(), ignore_eos=True)
    frequent = plain[0][0][len(prompts[0]) + 1]  # the best beam's second generated token
    engine = make_engine(artifact)
    engine.eos_token_ids = [frequent]
    outputs = beam_search(engine, [prompts[0]], BeamSearchParams(beam_width=3, max_tokens=5))
    expected = reference.run(prompts[0], 3, 5, eos={frequent})
    assert any(tokens[-1] == frequent and len(tokens) < len(prompts[0]) + 5 for tokens, _ in expected), (
        "the test meant to produce a completed (EOS-terminated) hypothesis")
    assert_matches(outputs, [expected])
    ignored = beam_search(engine, [prompts[0]], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    assert_matches(ignored, [reference.run(prompts[0], 3, 5, eos={frequent}, ignore_eos=True)])
    assert_pool_full(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_a_tiny_pool_equals_the_reference(artifact, reference, prompts, mode):
    # 7 blocks = 112 slots; the two prompts' 6 beams of up to 46 tokens need more unless they share.
    engine = make_engine(artifact, num_kv_blocks=7, max_num_batched_tokens=24, preemption_mode=mode,
                         swap_space="256KiB")
    eos = set(engine.eos_token_ids)
    outputs = beam_search(engine, prompts, BeamSearchParams(beam_width=3, max_tokens=6))
    assert_matches(outputs, [reference.run(prompt, 3, 6, eos) for prompt in prompts])
    assert engine.scheduler.preemptions[mode] > 0, f"the tiny pool was meant to force {mode} preemption"
    assert_pool_full(engine)


def test_beam_search_with_fewer_sequence_slots_than_beams(artifact, reference, prompts):
    engine = make_engine(artifact, max_num_seqs=2)
    eos = set(engine.eos_token_ids)
    outputs = beam_search(engine, prompts, BeamSearchParams(beam_width=3, max_tokens=4))
    assert_matches(outputs, [reference.run(prompt, 3, 4, eos) for prompt in prompts])
    assert_pool_full(engine)


def test_beams_share_their_common_history(artifact, reference, prompts):
    """Four beams of a 40-token prompt (3 blocks each when private) run in 7 blocks without preemption."""
    engine = make_engine(artifact, num_kv_blocks=7)
    eos = set(engine.eos_token_ids)
    outputs = beam_search(engine, [prompts[1]], BeamSearchParams(beam_width=4, max_tokens=8))
    assert_matches(outputs, [reference.run(prompts[1], 4, 8, eos)])
    assert engine.scheduler.num_preemptions == 0, "4 beams x 3 blocks = 12 > 7: the beams cannot have shared"
    assert_pool_full(engine)


def test_beams_stop_at_max_model_len(artifact, reference, prompts):
    engine = make_engine(artifact, max_model_len=26)
    eos = set(engine.eos_token_ids)
    outputs = beam_search(engine, [prompts[0]], BeamSearchParams(beam_width=2, max_tokens=10))
    assert all(len(hypothesis.tokens) == 26 for hypothesis in outputs[0].sequences)
    assert_matches(outputs, [reference.run(prompts[0], 2, 26 - len(prompts[0]), eos)])
    assert_pool_full(engine)
