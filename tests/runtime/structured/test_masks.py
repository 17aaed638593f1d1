"""Step masks: the bitmask's bits as banned tokens, rows of proposals with the state rolled back, the masked fill."""

from __future__ import annotations

import torch

from octavo.runtime.structured.masks import (
    MaskJob,
    MaskWorker,
    banned_from_bitmask,
    bitmask_words,
    compute_step_mask,
    mask_banned_tokens,
)
from octavo.runtime.structured.matcher import GrammarState
from octavo.runtime.structured.spec import StructuredOutputs
from tests.runtime.structured.conftest import EOS, VOCAB_SIZE


def test_banned_tokens_are_the_zero_bits():
    vocab = 70  # three words, the last one partly past the vocabulary
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(0))
    expected = [[not (int(bitmask[row, token // 32]) >> (token % 32)) & 1 for token in range(vocab)]
                for row in range(3)]
    assert banned_from_bitmask(bitmask, vocab).tolist() == expected


def allowed_after(grammars, spec, tokens: list[int]) -> set[int]:
    """The tokens a fresh matcher allows after `tokens` (the reference, one state at a time)."""
    state = GrammarState.start(grammars.compile(spec))
    for token in tokens:
        assert state.accept(token)
    bitmask = torch.zeros(1, bitmask_words(VOCAB_SIZE), dtype=torch.int32)
    state.fill(bitmask, 0)
    return set((~banned_from_bitmask(bitmask, VOCAB_SIZE)[0]).nonzero().view(-1).tolist())


def allowed_rows(mask, row: int) -> set[int]:
    return set((~mask.banned[row]).nonzero().view(-1).tolist())


def test_proposal_rows_follow_the_proposals_and_the_state_is_rolled_back(grammars, tokenizer):
    spec = StructuredOutputs(regex="(cat|dog) [0-9]{2}")
    tokens = tokenizer.encode("cat 42", add_special_tokens=False)
    state = GrammarState.start(grammars.compile(spec))
    assert state.accept(tokens[0])
    job = MaskJob(state, row=1, spec_tokens=tokens[1:], spec_rows=[3, 4, 5][:len(tokens) - 1])
    mask = compute_step_mask([job], 6, VOCAB_SIZE)
    assert allowed_rows(mask, 1) == allowed_after(grammars, spec, tokens[:1])
    for offset, row in enumerate(job.spec_rows):
        assert allowed_rows(mask, row) == allowed_after(grammars, spec, tokens[:offset + 2])
    assert allowed_rows(mask, 0) == set(range(VOCAB_SIZE))  # no job: every token allowed
    assert mask.constrained_rows == {1, *job.spec_rows}
    # Rolled back: the state still allows exactly what it allowed after the first token.
    assert state.valid_prefix(tokens[1:]) == len(tokens) - 1
    assert EOS in allowed_after(grammars, spec, tokens) and len(allowed_after(grammars, spec, tokens)) == 1


def test_rows_after_a_rejected_proposal_are_unconstrained(grammars, tokenizer):
    spec = StructuredOutputs(choice=["yes", "no"])
    state = GrammarState.start(grammars.compile(spec))
    bad = tokenizer.encode("maybe", add_special_tokens=False)
    mask = MaskWorker(VOCAB_SIZE).submit([MaskJob(state, 0, bad[:2], [1, 2][:len(bad[:2])])], 3).result()
    assert mask.constrained_rows == {0}
    assert allowed_rows(mask, 0) == allowed_after(grammars, spec, [])
    assert allowed_rows(mask, 1) == set(range(VOCAB_SIZE))
    assert mask.select([1, 2], torch.device("cpu")) is None
    assert mask.select([2, 0], torch.device("cpu")).tolist() == [mask.banned[2].tolist(), mask.banned[0].tolist()]


def test_masked_fill_and_a_row_left_without_tokens():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    processed = logits.clone()
    processed[1, 2] = float("-inf")  # min_tokens banned the stop token 2 of row 1
    banned = torch.tensor([[False, True, False], [True, True, False]])  # row 1's grammar allows only token 2
    masked = mask_banned_tokens(processed, logits, banned, emptiable_rows=[1])
    inf = float("-inf")
    assert masked.tolist() == [[1.0, inf, 3.0], [inf, inf, 6.0]]
    assert processed[0, 1] == 2.0  # a new tensor: the input is unchanged
