"""Sampler: greedy choice and logit processing (penalties, bias, min_tokens, temperature, top-k/p, min-p)
against their definitions, computed independently in tests/runtime/sampler_reference.py."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from octavo.runtime.sampler import Sampler, SamplingRow
from octavo.runtime.sampling_params import SamplingParams
from tests.runtime.sampler_reference import (
    HYPOTHESIS,
    assert_samples_follow,
    greedy_token,
    has_clear_winner,
    logit_lists,
    reference_distribution,
    reference_processed_logits,
    sample_many,
    softmax,
)


@HYPOTHESIS
@given(rows=st.lists(logit_lists, min_size=1, max_size=6))
def test_greedy_is_argmax(rows):
    assume(all(has_clear_winner(r) for r in rows))
    batch = [SamplingRow(SamplingParams(temperature=0.0), [], [], None) for _ in rows]
    tokens = Sampler(8, [])(torch.tensor(rows), batch).token_ids.tolist()
    assert tokens == [max(range(8), key=lambda i: r[i]) for r in rows]


@HYPOTHESIS
@given(
    raw=logit_lists,
    prompt=st.lists(st.integers(0, 7), max_size=6),
    output=st.lists(st.integers(0, 7), max_size=8),
    repetition=st.floats(0.3, 3.0),
    frequency=st.floats(-2.0, 2.0),
    presence=st.floats(-2.0, 2.0),
    bias=st.dictionaries(st.integers(0, 9), st.floats(-5.0, 5.0), max_size=3),
    min_tokens=st.integers(0, 4),
    ignore_eos=st.booleans(),
)
def test_greedy_follows_all_logit_processing(
    raw, prompt, output, repetition, frequency, presence, bias, min_tokens, ignore_eos
):
    params = SamplingParams(
        temperature=0.0, repetition_penalty=repetition, frequency_penalty=frequency,
        presence_penalty=presence, logit_bias=bias, min_tokens=min_tokens, max_tokens=None,
        stop_token_ids=[6], ignore_eos=ignore_eos,
    )
    expected = reference_processed_logits(raw, params, prompt, output, eos_ids=[7])
    assume(has_clear_winner(expected))
    row = SamplingRow(params, prompt, output, None)
    token = Sampler(8, [7])(torch.tensor([raw]), [row]).token_ids.item()
    assert token == max(range(8), key=lambda i: expected[i])


# ----- each logit processor against its formula, at the decision threshold -----


def sides_of(threshold):
    """Values just above and just below a threshold, relative to its size."""
    step = 1e-3 * max(1.0, abs(threshold))
    return [(threshold + step, 1), (threshold - step, 0)]


@given(raw=st.floats(-5.0, 5.0).filter(lambda v: abs(v) > 0.01), penalty=st.floats(0.2, 3.0))
@settings(max_examples=40, deadline=None)
def test_repetition_penalty_formula(raw, penalty):
    penalized = raw / penalty if raw > 0 else raw * penalty
    for where in ("prompt", "output"):
        context = {where: [0]}
        for competitor, winner in sides_of(penalized):
            # Token 1 is unseen, so it is not penalized: it wins exactly when above the penalized value.
            token = greedy_token([raw, competitor, -50.0], repetition_penalty=penalty, **context)
            assert token == winner, (where, raw, penalty, competitor)


@given(
    raw=st.floats(-3.0, 3.0), count=st.integers(1, 4),
    frequency=st.floats(-2.0, 2.0), presence=st.floats(-2.0, 2.0),
)
@settings(max_examples=40, deadline=None)
def test_frequency_and_presence_penalty_formula(raw, count, frequency, presence):
    penalized = raw - frequency * count - presence
    for competitor, winner in sides_of(penalized):
        token = greedy_token(
            [raw, competitor, -50.0], output=[0] * count + [2],
            frequency_penalty=frequency, presence_penalty=presence,
        )
        assert token == winner


def test_frequency_and_presence_penalties_ignore_the_prompt():
    # Token 0 is in the prompt only: unpenalized, it beats token 1.
    token = greedy_token([1.0, 0.9], prompt=[0, 0, 0], frequency_penalty=2.0, presence_penalty=2.0)
    assert token == 0


@given(raw=st.floats(-3.0, 3.0), bias=st.floats(-100.0, 100.0))
@settings(max_examples=40, deadline=None)
def test_logit_bias_is_added(raw, bias):
    for competitor, winner in sides_of(raw + bias):
        assert greedy_token([raw, competitor, -500.0], logit_bias={0: bias}) == winner


def test_logit_bias_comes_before_repetition_penalty():
    # Bias first: (-1 + 2) / 2 = 0.5 > 0.25. Penalty first it would be -1 * 2 + 2 = 0 < 0.25.
    assert greedy_token([-1.0, 0.25], prompt=[0], logit_bias={0: 2.0}, repetition_penalty=2.0) == 0


def test_logit_bias_outside_vocab_is_ignored():
    assert greedy_token([0.0, 1.0], logit_bias={5: 100.0}) == 1


def test_min_tokens_masks_eos_and_stop_ids():
    raw = [9.0, 8.0, 7.0, 6.0, 0.0]  # EOS ids 0 and 2, stop id 1
    options = {"eos_ids": [0, 2], "stop_token_ids": [1], "min_tokens": 2}
    assert greedy_token(raw, output=[], **options) == 3
    assert greedy_token(raw, output=[4], **options) == 3
    assert greedy_token(raw, output=[4, 4], **options) == 0
    # ignore_eos: EOS does not end generation, so it is not masked; stop ids still are.
    assert greedy_token(raw, output=[4], ignore_eos=True, **options) == 0
    assert greedy_token([1.0, 8.0, 0.0], output=[], ignore_eos=True, stop_token_ids=[1], min_tokens=1) == 0


def test_min_tokens_masks_eos_when_sampling():
    raw = [5.0, 1.0, 0.5, 0.0]
    params = SamplingParams(min_tokens=3)
    samples = sample_many(raw, params, output=[1, 1], eos_ids=[0])
    assert_samples_follow(samples, reference_distribution(
        reference_processed_logits(raw, params, output=[1, 1], eos_ids=[0]), params))
    # Once min_tokens are out, EOS is likely again.
    assert (sample_many(raw, params, output=[1, 1, 1], eos_ids=[0]) == 0).float().mean() > 0.9


# ----- sampling distributions -----


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature):
    raw = [1.0, 0.5, 0.0, -0.5, -1.0, 2.0]
    samples = sample_many(raw, SamplingParams(temperature=temperature))
    assert_samples_follow(samples, softmax([v / temperature for v in raw]))
    if temperature != 1.0:
        with pytest.raises(AssertionError):
            assert_samples_follow(samples, softmax(raw))


@pytest.mark.parametrize("top_k", [1, 2, 5, 7])
def test_top_k_keeps_exactly_k(top_k):
    raw = [0.3, 1.2, -0.4, 0.9, 0.0, 1.5, -1.0]
    samples = sample_many(raw, SamplingParams(top_k=top_k, temperature=1.5))
    highest = sorted(range(7), key=lambda i: -raw[i])[:top_k]
    assert set(samples.unique().tolist()) == set(highest)
    kept = [v / 1.5 if i in highest else -math.inf for i, v in enumerate(raw)]
    assert_samples_follow(samples, softmax(kept))


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3})]
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05 - 1e-4, 1e-4]
    samples = sample_many([math.log(p) for p in probs], SamplingParams(top_p=top_p))
    assert set(samples.unique().tolist()) == kept
    mass = sum(probs[t] for t in kept)
    assert_samples_follow(samples, [p / mass if t in kept else 0.0 for t, p in enumerate(probs)])


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    samples = sample_many([math.log(p) for p in probs], SamplingParams(min_p=0.3))
    kept = {t for t, p in enumerate(probs) if p >= 0.3 * 0.4}  # {0, 1, 2}
    assert set(samples.unique().tolist()) == kept
    mass = sum(probs[t] for t in kept)
    assert_samples_follow(samples, [p / mass if t in kept else 0.0 for t, p in enumerate(probs)])




# ----- 16-bit logits -----


@pytest.mark.parametrize("logprob_rows", [None, [0, 2]], ids=["all-rows", "some-rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_sample_as_their_float32_values(dtype, logprob_rows):
    """A 16-bit graph's logits give exactly what their float32 widening (exact) gives: tokens, logprobs, ranks
    and top logprobs of greedy (with a tie), seeded random, biased, penalized and min_tokens rows."""
    vocab = 300
    logits = (torch.randn(6, vocab + 4, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    logits[0, 20] = logits[0, 10] = logits[0, :vocab].max()  # tied maxima: the first index wins
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1, logprobs=2),
              SamplingParams(temperature=0.0, logit_bias={5: 4.0}),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], max_tokens=None)]

    def sample(values: torch.Tensor):
        rows = [SamplingRow(p, [1, 2, 3], [4, 5], None if p.seed is None else torch.Generator().manual_seed(p.seed))
                for p in params]
        return Sampler(vocab, [7])(values, rows, logprob_rows)

    narrow, wide = sample(logits), sample(logits.float())
    assert narrow.token_ids[0].item() == 10
    for name in ("token_ids", "sampled_logprobs", "sampled_ranks", "top_logprobs", "top_token_ids"):
        torch.testing.assert_close(getattr(narrow, name), getattr(wide, name), rtol=0, atol=0, equal_nan=True)
