"""CharacterBound: the character-count lower bound on tokens never exceeds what the real tokenizer produces."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.serve.prompt_limits import CharacterBound

MAX_EXAMPLES = int(os.environ.get("OCTAVO_FUZZ_EXAMPLES", "300"))

# Every character but surrogates (the server refuses those before tokenizing), with the tokenizer's
# hard cases mixed in: the control characters it drops, and runs its longest tokens cover.
characters = st.characters(exclude_categories=["Cs"])
runs = st.sampled_from(["\n" + " " * 80, "#" * 80, " " * 81, "-" * 64, "\x04", "\x1d", "<|im_start|>", "\r\n"])
texts = st.lists(st.one_of(characters, runs), max_size=60).map("".join)


@pytest.fixture(scope="module")
def tokenizer(smollm2_source):
    return smollm2_source.tokenizer


@pytest.fixture(scope="module")
def bound(tokenizer) -> CharacterBound:
    bound = CharacterBound.of(tokenizer)
    assert bound is not None
    return bound


def test_the_bundled_tokenizer_bound_comes_from_its_vocabulary(tokenizer, bound):
    longest = max(tokenizer.get_vocab(), key=len)
    assert bound.max_chars_per_token == len(longest) == 81
    assert tokenizer.encode("\n" + " " * 80) == [tokenizer.get_vocab()[longest]]  # one token, 81 characters
    for char in bound.droppable:  # what the bound counts as no token gives none, or one unknown token for the run
        # (transformers' GGUF converter drops such bytes in some releases and maps them to <unk> in others, 5.17):
        # either way the bound's count stays below the real one.
        assert tokenizer.encode(char * 5) in ([], [tokenizer.unk_token_id])
    assert tokenizer.encode("a") != []


@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None)
@given(texts)
def test_no_text_encodes_to_fewer_tokens_than_the_bound(tokenizer, bound, text):
    assert len(tokenizer.encode(text)) >= bound.min_tokens(text)
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= bound.min_tokens(text)


def test_no_bound_for_a_tokenizer_that_can_drop_characters():
    """Whitespace splitting drops spaces and WordPiece turns a whole unknown word into one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.encode(" " * 50) == [] and len(tokenizer.encode("zzzzzzzz")) == 1
    assert CharacterBound.of(tokenizer) is None
