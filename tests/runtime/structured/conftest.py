"""Fixtures of the structured-output tests: one grammar cache over the bundled tokenizer's vocabulary."""

from __future__ import annotations

import pytest

from octavo.runtime.structured.grammars import GrammarCache

VOCAB_SIZE = 49152
EOS = 2


@pytest.fixture(scope="package")
def tokenizer(smollm2_source):
    return smollm2_source.tokenizer


@pytest.fixture(scope="package")
def grammars(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, VOCAB_SIZE, [EOS])
