"""One sequence's position in its grammar: which tokens may come next, given the tokens so far.

A `GrammarState` wraps an xgrammar GrammarMatcher. It advances with every token the sequence
appends (`accept`), answers which tokens may follow as a bitmask row (`fill`, 32 tokens per int32,
bit set = allowed), and can be forked (parallel samples, beams) and rolled back (speculative
proposals are accepted to compute the masks that verify them, then taken back). Once the grammar
is complete only the stop tokens are allowed; accepting one terminates the state.
"""

from __future__ import annotations

import torch


class GrammarState:
    """The matcher of one sequence (see the module docstring)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    @classmethod
    def start(cls, compiled_grammar) -> GrammarState:
        import xgrammar

        return cls(xgrammar.GrammarMatcher(compiled_grammar))

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete and nothing may follow."""
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) when the grammar does not allow it here."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fork(self) -> GrammarState:
        """An independent copy at the same position."""
        return GrammarState(self._matcher.fork())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, ceil(V / 32)] bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows in turn (the state is left as it was)."""
        accepted = 0
        for token_id in token_ids:
            if self.is_terminated or not self.accept(token_id):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted
