"""Sampler: every parameter against its definition, computed independently here with plain loops.

Distribution checks draw many samples in one batched call (every row the same request) with a fixed
sampler seed, and compare the empirical distribution to the one the definitions give, with a
chi-square bound (at a 1e-6 false-alarm level) and a total-variation bound.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from octavo.runtime import sampler as sampler_module
from octavo.runtime.sampler import Sampler, SamplingRow
from octavo.runtime.sampling_params import SamplingParams

NUM_SAMPLES = 40_000
HYPOTHESIS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


# ----- independent references -----


def reference_processed_logits(raw, params, prompt=(), output=(), eos_ids=()):
    """Logits after bias, min_tokens, repetition, frequency and presence penalties (float64 loops)."""
    values = [float(v) for v in raw]
    for token, bias in (params.logit_bias or {}).items():
        if token < len(values):
            values[token] += bias
    if len(output) < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
        for token in banned:
            values[token] = -math.inf
    for token in set(prompt) | set(output):
        value = values[token]
        penalty = params.repetition_penalty
        values[token] = value / penalty if value > 0 else value * penalty
    for token in set(output):
        count = list(output).count(token)
        values[token] -= params.frequency_penalty * count + params.presence_penalty
    return values


def softmax(values):
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    weights = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(weights)
    return [w / total for w in weights]


def reference_distribution(logits, params):
    """Sampling distribution of a random row from its processed logits, by the definitions."""
    scaled = [v / params.temperature for v in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = set(order[: params.top_k]) if params.top_k > 0 else set(order)
    probs = softmax([v if i in kept else -math.inf for i, v in enumerate(scaled)])
    if params.top_p < 1.0:
        nucleus, mass = set(), 0.0
        for token in order:
            if token in kept and mass < params.top_p:
                nucleus.add(token)
                mass += probs[token]
        probs = [p if i in nucleus else 0.0 for i, p in enumerate(probs)]
    highest = max(probs)
    probs = [p if p >= params.min_p * highest else 0.0 for p in probs]
    total = sum(probs)
    return [p / total for p in probs]


def chi_square_critical(degrees_of_freedom, z_score=4.75):
    """Wilson-Hilferty approximation of the chi-square quantile for a 1e-6 upper tail."""
    k = degrees_of_freedom
    return k * (1 - 2 / (9 * k) + z_score * math.sqrt(2 / (9 * k))) ** 3


def assert_samples_follow(samples, expected):
    counts = torch.bincount(samples, minlength=len(expected)).tolist()
    assert len(counts) == len(expected), "a token outside the vocabulary was sampled"
    total = sum(counts)
    for token, probability in enumerate(expected):
        if probability == 0.0:
            assert counts[token] == 0, f"token {token} is outside the support but was sampled"
        elif probability >= 1e-3:  # expected >= 40 times: missing it has probability < e^-40
            assert counts[token] > 0, f"token {token} (p={probability:.4f}) was never sampled"
    buckets = [(counts[t], p * total) for t, p in enumerate(expected) if p * total >= 5]
    rare_count = total - sum(c for c, _ in buckets)
    rare_expected = total - sum(e for _, e in buckets)
    if rare_expected >= 5:
        buckets.append((rare_count, rare_expected))
    if len(buckets) >= 2:
        statistic = sum((c - e) ** 2 / e for c, e in buckets)
        assert statistic < chi_square_critical(len(buckets) - 1), f"chi-square {statistic:.1f}"
    variation = 0.5 * sum(abs(c / total - p) for c, p in zip(counts, expected, strict=True))
    assert variation < 0.02, f"total variation {variation:.4f}"


# ----- helpers to drive the sampler -----


def sample_many(logits_row, params, prompt=(), output=(), eos_ids=(), seed=1234):
    """NUM_SAMPLES tokens for one request, all drawn in one batched call."""
    row = SamplingRow(params, list(prompt), list(output), None)
    logits = torch.tensor(logits_row, dtype=torch.float32).expand(NUM_SAMPLES, -1)
    return Sampler(len(logits_row), eos_ids, seed=seed)(logits, [row] * NUM_SAMPLES).token_ids


def greedy_token(logits_row, prompt=(), output=(), eos_ids=(), **params):
    row = SamplingRow(SamplingParams(temperature=0.0, **params), list(prompt), list(output), None)
    logits = torch.tensor([logits_row], dtype=torch.float32)
    return Sampler(len(logits_row), eos_ids)(logits, [row]).token_ids.item()


logit_lists = st.lists(st.floats(-4.0, 4.0, allow_nan=False), min_size=8, max_size=8)


def has_clear_winner(values, margin=1e-3):
    finite = sorted((v for v in values if v != -math.inf), reverse=True)
    return len(finite) == 1 or finite[0] - finite[1] > margin


# ----- greedy -----


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
