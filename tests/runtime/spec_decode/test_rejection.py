"""Rejection sampling keeps the target's distribution, for sampled and deterministic proposals.

Each trial draws proposals, then the verifier's emitted tokens. Whatever the proposals, the first
emitted token must follow p_0, the second (in trials that accepted the first proposal) p_1, and so on.
With 20 000 trials over 8 tokens, a shift of 2% of the probability between any two tokens of
probabilities a, b <= 0.5 of the first position has noncentrality 20000 * 0.02^2 * (1/a + 1/b) >= 32,
which a chi-square test at the 1e-3 level (7 dof: critical value 24.3) detects with probability ~0.9.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from octavo.runtime.spec_decode.rejection import accept_greedy, accept_point_mass, accept_sampled
from tests.runtime.spec_decode.chi_square import SIGNIFICANCE, chi_square

VOCAB = 8
TRIALS = 20_000
NUM_PROPOSALS = 2


def _distribution(generator: torch.Generator, sparse: bool = False) -> torch.Tensor:
    logits = torch.randn(VOCAB, generator=generator) * 1.5
    if sparse:  # min-p / top-k style zeros
        logits[torch.randperm(VOCAB, generator=generator)[:3]] = float("-inf")
    return torch.softmax(logits, dim=0)


def _sources(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (lambda: torch.empty(VOCAB).exponential_(generator=generator),
            lambda: float(torch.rand(1, generator=generator)))


def _check_positions(emitted_runs: list[list[int]], target: torch.Tensor) -> None:
    """Position j of the emitted runs (where a run reaches it) follows target[j]."""
    for position in range(NUM_PROPOSALS + 1):
        counts = Counter(run[position] for run in emitted_runs if len(run) > position)
        if sum(counts.values()) < 200:
            continue
        result = chi_square(counts, dict(enumerate(target[position].tolist())))
        assert result.p_value > SIGNIFICANCE, f"position {position}: {result}"


@pytest.mark.parametrize("sparse_target", [False, True], ids=["dense", "sparse-target"])
def test_sampled_proposals_emit_target_distribution(sparse_target):
    generator = torch.Generator().manual_seed(1)
    target = torch.stack([_distribution(generator, sparse_target) for _ in range(NUM_PROPOSALS + 1)])
    draft = torch.stack([_distribution(generator) for _ in range(NUM_PROPOSALS)])
    proposals = torch.stack([torch.multinomial(draft[j], TRIALS, replacement=True, generator=generator)
                             for j in range(NUM_PROPOSALS)], dim=1).tolist()
    noise, uniform = _sources(2)
    runs = [accept_sampled(target, draft, proposal, noise, uniform)[0] for proposal in proposals]
    _check_positions(runs, target)
    accepted_first = sum(1 for run, proposal in zip(runs, proposals, strict=True) if len(run) > 1)
    # The acceptance rate of the first proposal is sum(min(p, q)) (1 - total variation).
    expected = float(torch.minimum(target[0], draft[0]).sum())
    assert abs(accepted_first / TRIALS - expected) < 0.02


def test_deterministic_proposals_emit_target_distribution():
    generator = torch.Generator().manual_seed(3)
    target = torch.stack([_distribution(generator) for _ in range(NUM_PROPOSALS + 1)])
    # Proposals from any rule at all (here: cycling through the vocabulary) must not bias the output.
    proposals = [[trial % VOCAB, (trial // VOCAB) % VOCAB] for trial in range(TRIALS)]
    noise, _ = _sources(4)
    runs = [accept_point_mass(target, proposal, noise)[0] for proposal in proposals]
    _check_positions(runs, target)


def test_accepted_count_and_emitted_tokens_agree():
    generator = torch.Generator().manual_seed(5)
    target = torch.stack([_distribution(generator) for _ in range(4)])
    noise, uniform = _sources(6)
    for _ in range(200):
        proposal = torch.randint(VOCAB, (3,), generator=generator).tolist()
        for emitted, accepted in (accept_point_mass(target, proposal, noise),
                                  accept_sampled(target, target[:3], proposal, noise, uniform)):
            assert emitted[:accepted] == proposal[:accepted]
            assert len(emitted) == accepted + 1
            assert accepted == 3 or emitted[accepted] != proposal[accepted]


def test_draft_equal_to_target_accepts_everything():
    generator = torch.Generator().manual_seed(7)
    target = torch.stack([_distribution(generator) for _ in range(4)])
    noise, uniform = _sources(8)
    for _ in range(100):
        proposal = [int(torch.multinomial(target[j], 1, generator=generator)) for j in range(3)]
        emitted, accepted = accept_sampled(target, target[:3], proposal, noise, uniform)
        assert accepted == 3 and emitted[:3] == proposal


def test_greedy_accepts_while_the_proposal_is_the_argmax():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 9]) == ([4, 5, 6], 2)
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == ([4, 5, 6, 7], 3)
    assert accept_greedy([4, 5], [1]) == ([4], 0)
