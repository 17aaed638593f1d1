"""Sampler: sampled distributions, seeds, logprobs and prompt logprobs against their definitions.

Distribution checks draw many samples in one batched call (every row the same request) with a fixed
sampler seed, and compare the empirical distribution to the one the definitions give, with a
chi-square bound (at a 1e-6 false-alarm level) and a total-variation bound.
"""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from octavo.runtime import sampler as sampler_module
from octavo.runtime.sampler import Sampler, SamplingRow
from octavo.runtime.sampling_params import SamplingParams
from tests.runtime.sampler_reference import (
    HYPOTHESIS,
    NUM_SAMPLES,
    assert_samples_follow,
    logit_lists,
    reference_distribution,
    reference_processed_logits,
    sample_many,
    softmax,
)


def _boundaries_are_clear(processed, params):
    """Reject cases where float32 vs float64 rounding could flip a top-k/top-p/min-p decision."""
    scaled = sorted((v / params.temperature for v in processed if v != -math.inf), reverse=True)
    if len(set(round(v, 4) for v in scaled)) != len(scaled):
        return False
    probs = sorted(softmax(scaled), reverse=True)
    if params.top_k > 0:
        probs = softmax([math.log(p) if i < params.top_k else -math.inf for i, p in enumerate(probs)])
    cumulative = 0.0
    for p in probs:
        cumulative += p
        if abs(cumulative - params.top_p) < 1e-4:
            return False
    return all(abs(p - params.min_p * probs[0]) > 1e-4 * probs[0] for p in probs)


@settings(HYPOTHESIS, max_examples=12, derandomize=True)  # statistical: the same cases every run
@given(
    raw=logit_lists,
    temperature=st.floats(0.3, 2.0),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.6),
    output=st.lists(st.integers(0, 7), max_size=5),
    repetition=st.floats(0.5, 2.0),
    frequency=st.floats(-1.0, 1.0),
)
def test_sampling_distribution_matches_definitions(
    raw, temperature, top_k, top_p, min_p, output, repetition, frequency
):
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition, frequency_penalty=frequency,
    )
    processed = reference_processed_logits(raw, params, prompt=[0], output=output)
    assume(_boundaries_are_clear(processed, params))
    samples = sample_many(raw, params, prompt=[0], output=output)
    assert_samples_follow(samples, reference_distribution(processed, params))


# ----- seeds -----


def _step_logits(step, vocab):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(100 + step))


def _run_seeded_request(layout, sampler_seed, steps=12, vocab=40):
    """Tokens of the request with seed 42, placed at row ``layout.index('target')`` among others."""
    sampler = Sampler(vocab, [], seed=sampler_seed)
    requests = {}
    for name in layout:
        seed = {"target": 42, "other_seeded": 7}.get(name)
        params = SamplingParams(seed=seed, top_p=0.95, temperature=0.9, max_tokens=None)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        requests[name] = SamplingRow(params, [1, 2], [], generator)
    for step in range(steps):
        rows = [requests[name] for name in layout]
        noise = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(step))
        logits = torch.stack([
            _step_logits(step, vocab) if name == "target" else noise[i] for i, name in enumerate(layout)
        ])
        tokens = sampler(logits, rows).token_ids.tolist()
        for row, token in zip(rows, tokens, strict=True):
            row.output_token_ids.append(token)
    return requests["target"].output_token_ids


def test_seeded_request_is_reproducible_regardless_of_batch():
    alone = _run_seeded_request(["target"], sampler_seed=0)
    first = _run_seeded_request(["target", "unseeded", "other_seeded"], sampler_seed=1)
    last = _run_seeded_request(["unseeded", "other_seeded", "unseeded_2", "target"], sampler_seed=2)
    assert alone == first == last


def _uniform_tokens(request_seed, sampler_seed=0, rows=64, vocab=40):
    """Tokens of ``rows`` copies of one request over uniform logits (every row a fresh draw)."""
    params = SamplingParams(seed=request_seed)
    generator = torch.Generator().manual_seed(request_seed) if request_seed is not None else None
    batch = [SamplingRow(params, [], [], generator)] * rows
    return Sampler(vocab, [], seed=sampler_seed)(torch.zeros(rows, vocab), batch).token_ids.tolist()


def test_different_seeds_and_unseeded_rows_differ():
    assert _uniform_tokens(1) != _uniform_tokens(2)
    assert _uniform_tokens(None, sampler_seed=5) == _uniform_tokens(None, sampler_seed=5)
    assert _uniform_tokens(None, sampler_seed=5) != _uniform_tokens(None, sampler_seed=6)


# ----- logprobs and ranks -----


def test_logprobs_and_ranks_come_from_raw_logits():
    torch.manual_seed(0)
    raw = torch.randn(4, 12)
    raw[2, 3] = raw[2, 5] = raw[2].max() + 1  # a tie for first place
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logit_bias={7: 50.0}, logprobs=3), [], [], None),
        SamplingRow(SamplingParams(repetition_penalty=1.8, top_k=4), [1, 2, 3], [4], None),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias={3: 80.0}), [], [], None),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5), [], [], None),
    ]
    result = Sampler(12, [])(raw, rows)
    assert result.token_ids[0] == 7 and result.token_ids[2] == 3
    assert result.sampled_ranks[2] == 1  # tied for first: a tie does not push the rank down
    for row in range(4):
        values = raw[row].double().tolist()
        normalizer = math.log(sum(math.exp(v) for v in values))
        logprobs = [v - normalizer for v in values]
        chosen = result.token_ids[row].item()
        assert result.sampled_logprobs[row].item() == pytest.approx(logprobs[chosen], abs=1e-5)
        assert result.sampled_ranks[row].item() == 1 + sum(v > values[chosen] for v in values)
        expected_top = sorted(range(12), key=lambda i: -values[i])[:5]
        expected_values = [logprobs[i] for i in expected_top]
        assert result.top_logprobs[row].tolist() == pytest.approx(expected_values, abs=1e-5)
        if row != 2:  # row 2 has a tie inside the top 5; its order among equals is arbitrary
            assert result.top_token_ids[row].tolist() == expected_top
    assert result.top_logprobs.shape == (4, 5) and result.top_logprobs.dtype == torch.float32
    assert result.token_ids.dtype == result.sampled_ranks.dtype == torch.int64


def test_no_top_logprobs_when_no_row_asks():
    result = Sampler(5, [])(torch.randn(2, 5), [SamplingRow(SamplingParams(), [], [], None)] * 2)
    assert result.top_logprobs is None and result.top_token_ids is None
    assert result.sampled_logprobs.shape == (2,)


def test_zero_logprobs_gives_empty_top_columns():
    result = Sampler(5, [])(torch.randn(1, 5), [SamplingRow(SamplingParams(logprobs=0), [], [], None)])
    assert result.top_logprobs.shape == (1, 0)


# ----- padded vocabulary, dtypes, inputs -----


def test_padded_vocab_is_never_sampled_or_reported():
    vocab = 6
    logits = torch.randn(NUM_SAMPLES // 10, vocab + 4)
    logits[:, vocab:] = 1e4
    rows = [
        SamplingRow(SamplingParams(temperature=0.0 if i % 2 else 1.0, logprobs=8), [], [], None)
        for i in range(logits.shape[0])
    ]
    result = Sampler(vocab, [])(logits, rows)
    assert result.token_ids.max().item() < vocab
    assert result.top_token_ids.max().item() < vocab and result.top_token_ids.shape[1] == vocab
    expected = torch.log_softmax(logits[:, :vocab].double(), dim=-1)
    chosen = expected.gather(1, result.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(result.sampled_logprobs.double(), chosen, atol=1e-5)


def test_bf16_logits_match_their_float32_values():
    torch.manual_seed(1)
    logits = torch.randn(16, 30).to(torch.bfloat16)
    rows = [
        SamplingRow(SamplingParams(temperature=[0.0, 0.8][i % 2], top_p=0.9, logprobs=2), [3], [4], None)
        for i in range(16)
    ]
    from_bf16 = Sampler(30, [], seed=3)(logits, rows)
    from_fp32 = Sampler(30, [], seed=3)(logits.float(), rows)
    assert torch.equal(from_bf16.token_ids, from_fp32.token_ids)
    assert from_bf16.sampled_logprobs.dtype == from_bf16.top_logprobs.dtype == torch.float32
    assert torch.equal(from_bf16.sampled_logprobs, from_fp32.sampled_logprobs)


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 7)
    before = logits.clone()
    params = SamplingParams(logit_bias={1: 5.0}, repetition_penalty=2.0, min_tokens=1, top_k=2)
    Sampler(7, [0])(logits, [SamplingRow(params, [1, 2], [], None)] * 2)
    assert torch.equal(logits, before)


def test_mismatched_logits_shape_is_rejected():
    with pytest.raises(ValueError, match="rows"):
        Sampler(8, [])(torch.zeros(2, 8), [SamplingRow(SamplingParams(), [], [], None)])
    with pytest.raises(ValueError, match="vocab size"):
        Sampler(8, [])(torch.zeros(1, 7), [SamplingRow(SamplingParams(), [], [], None)])


# ----- prompt logprobs -----


@pytest.mark.parametrize("chunk_rows", [2, 1024])
def test_prompt_logprobs(monkeypatch, chunk_rows):
    monkeypatch.setattr(sampler_module, "PROMPT_LOGPROBS_CHUNK_ROWS", chunk_rows)
    torch.manual_seed(2)
    vocab, prompt = 9, [4, 1, 8, 8, 0, 2]
    logits = torch.randn(len(prompt), vocab + 3).to(torch.bfloat16)
    logits[:, vocab:] = 50.0  # padded columns must not count
    scored = Sampler(vocab, []).prompt_logprobs(logits, prompt, num_top=3)
    assert scored.token_ids.tolist() == prompt[1:]
    for position in range(len(prompt) - 1):
        values = logits[position, :vocab].double().tolist()
        normalizer = math.log(sum(math.exp(v) for v in values))
        target = prompt[position + 1]
        assert scored.logprobs[position].item() == pytest.approx(values[target] - normalizer, abs=1e-5)
        assert scored.ranks[position].item() == 1 + sum(v > values[target] for v in values)
        top = sorted((v - normalizer for v in values), reverse=True)[:3]
        assert scored.top_logprobs[position].tolist() == pytest.approx(top, abs=1e-5)
        assert scored.top_token_ids[position].max().item() < vocab


def test_prompt_logprobs_of_one_token_prompt_is_empty():
    scored = Sampler(5, []).prompt_logprobs(torch.randn(1, 5), [3], num_top=2)
    assert scored.logprobs.shape == (0,) and scored.top_logprobs.shape == (0, 2)
    with pytest.raises(ValueError):
        Sampler(5, []).prompt_logprobs(torch.randn(1, 5), [3, 4, 1], num_top=2)

