"""Independent references for the sampler tests: each parameter's definition, computed with plain loops."""

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

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

