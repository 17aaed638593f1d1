"""N-gram (prompt lookup) proposer: continue the sequence the way it continued before.

For n from ``ngram_max`` down to ``ngram_min``, the last n tokens of the sequence (prompt + output)
are looked up among its earlier n-grams; the most recent earlier occurrence wins, and the tokens
that followed it are proposed. When the occurrence ends so close to the end of the sequence that
fewer than k tokens follow it (a repeating pattern), the pattern is continued periodically. No model
runs: each sequence keeps an index from n-gram to the end of its latest earlier occurrence, extended
as tokens are appended.
"""

from __future__ import annotations

from octavo.runtime.sequence import Sequence
from octavo.runtime.spec_decode.proposer import Proposal, Proposer


class NgramIndex:
    """End positions (exclusive) of the latest occurrence of every n-gram of one token list,
    n in [n_min, n_max], over the n-grams that end before the list's last token."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min = n_min
        self.n_max = n_max
        self.latest_end: dict[tuple[int, ...], int] = {}
        self.indexed_ends = 0  # n-grams with an end <= this are indexed

    def update(self, token_ids: list[int]) -> None:
        """Index the n-grams ending before len(token_ids) (the suffix itself is not an earlier occurrence)."""
        last_end = len(token_ids) - 1
        for end in range(self.indexed_ends + 1, last_end + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.latest_end[tuple(token_ids[end - n:end])] = end
        self.indexed_ends = max(self.indexed_ends, last_end)

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """The `num_tokens` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        self.update(token_ids)
        length = len(token_ids)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            end = self.latest_end.get(tuple(token_ids[length - n:]))
            if end is not None:
                period = length - end
                return [token_ids[end + j] if j < period else token_ids[end + j % period]
                        for j in range(num_tokens)]
        return []


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own tokens (see the module docstring)."""

    name = "ngram"
    free = True

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.indexes: dict[Sequence, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        proposals = []
        for seq, count in zip(seqs, num_tokens, strict=True):
            index = self.indexes.get(seq)
            if index is None:
                index = self.indexes[seq] = NgramIndex(self.ngram_min, self.ngram_max)
            proposals.append(Proposal(index.propose(seq.token_ids, count) if count > 0 else []))
        return proposals

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq, None)

    def release_all_but(self, running: set[Sequence]) -> None:
        # The index depends only on the tokens, which preemption keeps: only finished sequences go.
        for seq in [seq for seq in self.indexes if seq.is_finished]:
            del self.indexes[seq]
