"""N-gram proposer against its definition, computed by a plain scan of the token list."""

from __future__ import annotations

import random

from octavo.runtime.spec_decode.ngram import NgramIndex


def reference_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Longest suffix n-gram (n_max..n_min) with an earlier occurrence; the latest such occurrence;
    the k tokens after it, the sequence extended periodically past its end."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                extended = list(tokens)
                while len(extended) < end + k:
                    extended.append(extended[len(extended) - (len(tokens) - end)])
                return extended[end:end + k]
    return []


def test_proposals_equal_the_definition_as_the_sequence_grows():
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([3, 5, 20])
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 4)
        index = NgramIndex(n_min, n_max)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        for _ in range(30):
            k = rng.randint(1, 5)
            assert index.propose(tokens, k) == reference_proposal(tokens, k, n_min, n_max), (trial, tokens)
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]


def test_copying_proposes_the_text_that_followed():
    text = [10, 11, 12, 13, 14, 15, 16, 17]
    index = NgramIndex(1, 3)
    assert index.propose([*text, 20, 12, 13], 4) == [14, 15, 16, 17]
    assert index.propose([*text, 20, 12, 13, 14, 99], 3) == []  # 99 never occurred before
    # A repeating pattern continues periodically past the end of the sequence.
    assert NgramIndex(1, 3).propose([5, 6, 5, 6, 5], 5) == [6, 5, 6, 5, 6]
