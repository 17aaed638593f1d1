"""Which proposed tokens the target accepts, and the token it adds: exact speculative sampling.

For one sequence with proposals x_1..x_k, ``target_probs`` row j (j = 0..k) is the target's sampling
distribution p_j for the token after the newest token and x_1..x_j, with every sampling parameter
applied (penalties and min_tokens counting x_1..x_j as output). Proposals are checked in order; the
first rejected one is replaced by a token drawn as below and the rest are dropped; when all k are
accepted, one more token is drawn from p_k. The emitted tokens therefore follow p exactly
(Leviathan et al. 2023; Chen et al. 2023):

- greedy rows: x_j is accepted while it equals argmax p_{j-1}; the replacement is that argmax;
- x_j drawn from a distribution q_{j-1} (a sampling draft model): accepted with probability
  min(1, p(x_j) / q(x_j)); on rejection the replacement is drawn from max(0, p - q), normalized;
- x_j chosen deterministically (n-gram lookup, a greedy draft: q is a point mass on x_j): the same
  rule reads "accept with probability p(x_j), else draw from p without x_j", which is exactly
  drawing y ~ p and accepting iff y = x_j, emitting y either way. It is implemented that way, with
  the exponential race the sampler uses (argmax of p / E, E ~ Exp(1) per token), drawing one noise
  vector per emitted token from the sequence's generator: a seeded request then emits the same
  tokens with or without n-gram speculation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NoiseSource = Callable[[], torch.Tensor]
"""Draws one Exp(1) noise vector [V] (from the sequence's generator, or the shared one)."""

UniformSource = Callable[[], float]
"""Draws one U[0, 1) value from the same generator."""


def accept_greedy(greedy_token_ids: list[int], proposal: list[int]) -> tuple[list[int], int]:
    """(emitted tokens, number of accepted proposals): proposals while they equal the target's choice."""
    accepted = 0
    while accepted < len(proposal) and proposal[accepted] == greedy_token_ids[accepted]:
        accepted += 1
    return [*proposal[:accepted], greedy_token_ids[accepted]], accepted


def accept_point_mass(target_probs: torch.Tensor, proposal: list[int], noise: NoiseSource) -> tuple[list[int], int]:
    """Deterministic proposals against random sampling: y_j ~ p_j by exponential race, accepted iff y_j = x_j."""
    emitted: list[int] = []
    for j in range(len(proposal) + 1):
        token = int((target_probs[j] / noise()).argmax())
        emitted.append(token)
        if j == len(proposal) or token != proposal[j]:
            break
    return emitted, len(emitted) - 1


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, proposal: list[int],
                   noise: NoiseSource, uniform: UniformSource) -> tuple[list[int], int]:
    """Proposals drawn from draft_probs: accept x with probability min(1, p(x) / q(x)), else draw
    from the normalized residual max(0, p - q)."""
    for j, token in enumerate(proposal):
        p, q = float(target_probs[j, token]), float(draft_probs[j, token])
        if uniform() * q < p:
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_min_(0.0)
        # A rejection implies q(x) > p(x), so the residual has mass (q(x) - p(x)) > 0; rounding in
        # float32 could still leave none, and then p itself is the right fallback (p ~= q).
        if float(residual.sum()) <= 0.0:
            residual = target_probs[j]
        return [*proposal[:j], int((residual / noise()).argmax())], j
    return [*proposal, int((target_probs[len(proposal)] / noise()).argmax())], len(proposal)
