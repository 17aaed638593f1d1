"""prompt_logprobs and logprobs against log_softmax of Hugging Face eager fp32 logits.

Prompt position p (p >= 1) is scored by the logits at position p - 1; the
first prompt token has no entry (None). Each entry holds the prompt token
and the top-N tokens with their raw log probability and rank. Generated
tokens' logprobs are the raw distribution's too, whatever sampling does.
"""

from __future__ import annotations

import random

import pytest
import torch

from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import make_engine, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-4
NUM_TOP = 4


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of HF logits at every position of `token_ids` [len, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(17)
    return [rng.randrange(3, 49000) for _ in range(37)]


def check_entry(entry: dict, token: int, reference: torch.Tensor, num_top: int) -> None:
    """`entry` describes `token` (and the top `num_top`) under the distribution `reference` [vocab]."""
    assert abs(entry[token].logprob - reference[token].item()) <= TOLERANCE
    assert entry[token].rank == 1 + int((reference > reference[token]).sum())
    values, token_ids = reference.topk(num_top)
    for rank, (value, top_token) in enumerate(zip(values.tolist(), token_ids.tolist(), strict=True), 1):
        assert top_token in entry, f"top-{rank} token {top_token} missing"
        assert abs(entry[top_token].logprob - value) <= TOLERANCE
        assert entry[top_token].rank == rank
    assert set(entry) <= {token, *token_ids.tolist()}


def check_prompt_logprobs(output: RequestOutput, prompt: list[int], reference: torch.Tensor) -> None:
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for position in range(1, len(prompt)):
        check_entry(entries[position], prompt[position], reference[position - 1], NUM_TOP)


@pytest.mark.parametrize("budget", [1024, 8], ids=["one-step", "chunked"])
def test_prompt_logprobs_equal_hf_log_softmax(artifact, hf_model, prompt, budget):
    engine = make_engine(artifact, max_num_batched_tokens=budget)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=NUM_TOP),
                       request_id="scored")
    output = run_to_completion(engine)["scored"]
    check_prompt_logprobs(output, prompt, hf_logprobs(hf_model, prompt))
    assert_pool_full(engine)


def test_prompt_logprobs_are_computed_for_every_position_even_when_the_prefix_is_cached(artifact, hf_model, prompt):
    engine = make_engine(artifact)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), request_id="warm")
    run_to_completion(engine)
    assert engine.block_manager.num_cached_blocks == 2
    lookups = engine.block_manager.stats.lookups
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=NUM_TOP),
                       request_id="scored")
    output = run_to_completion(engine)["scored"]
    assert engine.block_manager.stats.lookups == lookups, "a request that scores its prompt skips the cache"
    check_prompt_logprobs(output, prompt, hf_logprobs(hf_model, prompt))
    assert_pool_full(engine)


def test_prompt_logprobs_survive_preemption_mid_prompt(artifact, hf_model, prompt):
    """The scored request is preempted while its prompt is chunked; recomputing it adds no entries."""
    engine = make_engine(artifact, num_kv_blocks=4, max_num_batched_tokens=8)
    rng = random.Random(3)
    engine.add_request([rng.randrange(3, 49000) for _ in range(30)],
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id="older")
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                              prompt_logprobs=NUM_TOP), request_id="scored")
    request = engine.requests["scored"]
    scored = request.sequences[0]
    entries_when_preempted = []
    finals = {}
    while engine.has_unfinished_requests():
        preemptions = scored.num_preemptions
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if scored.num_preemptions > preemptions:
            entries_when_preempted.append(len(request.prompt_logprobs or []))
    assert any(1 < count < len(prompt) for count in entries_when_preempted), (
        f"the scored request was meant to be preempted mid-prompt ({entries_when_preempted})")
    check_prompt_logprobs(finals["scored"], prompt, hf_logprobs(hf_model, prompt))
    assert_pool_full(engine)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=NUM_TOP),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=4, max_tokens=6,
                   ignore_eos=True, logprobs=NUM_TOP),
], ids=["greedy", "processed-sampling"])
def test_logprobs_of_generated_tokens_are_those_of_the_raw_logits(artifact, hf_model, prompt, params):
    engine = make_engine(artifact)
    engine.add_request(prompt, params, request_id="gen")
    completion = run_to_completion(engine)["gen"].outputs[0]
    generated = completion.token_ids
    reference = hf_logprobs(hf_model, prompt + generated)
    assert len(completion.logprobs) == len(generated)
    total = 0.0
    for index, (token, entry) in enumerate(zip(generated, completion.logprobs, strict=True)):
        distribution = reference[len(prompt) - 1 + index]
        check_entry(entry, token, distribution, NUM_TOP)
        total += distribution[token].item()
    assert completion.cumulative_logprob == pytest.approx(total, abs=TOLERANCE * len(generated))
    if params.temperature == 0:
        assert all(entry[token].rank == 1 for token, entry in zip(generated, completion.logprobs, strict=True))
    assert_pool_full(engine)
