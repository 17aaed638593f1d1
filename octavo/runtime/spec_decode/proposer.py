"""The interface every proposer implements, and what it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from octavo.runtime.sequence import Sequence


@dataclass
class Proposal:
    """Tokens proposed after a sequence's newest token.

    ``draft_probs`` float32 [len(token_ids), V]: row j is the distribution token j was drawn from;
    None means each token was chosen deterministically (a point mass, as n-gram lookup or a greedy
    draft does).
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None


class Proposer(ABC):
    """Proposes tokens for running sequences and keeps whatever per-sequence state it needs."""

    name: str
    free: bool
    """True when proposing costs no model step (the policy then plans with the actual proposals)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        """Up to ``num_tokens[i]`` tokens to follow ``seqs[i].token_ids`` (fewer or none allowed)."""

    def release(self, seq: Sequence) -> None:  # noqa: B027 (stateless proposers need nothing)
        """Forget `seq` (finished, aborted or preempted): free what is held for it."""

    def release_all_but(self, running: set[Sequence]) -> None:  # noqa: B027
        """Release every sequence not in `running`."""

    def draft_seconds(self) -> float:
        """Wall time spent in model steps during the last `propose` call (0 for a free proposer)."""
        return 0.0
