"""Incremental detokenization of generated tokens, as vLLM does it (prefix/read offsets).

The decoder keeps all token ids it has seen (a few prompt tokens as context, then the output) and
two offsets into them: text before ``read_offset`` has been emitted; ``prefix_offset`` is where the
decoding window starts. After new tokens arrive, it decodes ``ids[prefix_offset:read_offset]`` (text
already emitted) and ``ids[prefix_offset:]``; the delta is the difference. If the longer decode ends
with U+FFFD, the last token ends inside a multi-byte UTF-8 character, so nothing is emitted until
later tokens complete it. Decoding a window instead of single tokens keeps context-dependent
decoders (SentencePiece's leading "▁", byte-level BPE's split characters) right, and the prompt
context makes the first output token's leading space right.

Invariant: the concatenated deltas equal ``tokenizer.decode(output_ids, skip_special_tokens=...)``
whenever that decode does not end with U+FFFD (a trailing incomplete character is held back).

Fast tokenizers whose ``decode`` is their Rust backend's alone (no clean-up of spaces) run the same
algorithm in Rust, through ``tokenizers.decoders.DecodeStream``: one call per token instead of two
Python decodes of the window (0.6 against 5.2 us a token on SmolLM2's tokenizer). It starts from one
step over the prompt context, which leaves it in the state above when the context has text, and it
takes a chunk of several ids (speculative decoding) one id at a time, so text that a later id of the
chunk leaves incomplete does not hold back the text before it. It refuses a window whose new decode
does not begin with the text already emitted (a decoder that rewrites across tokens can do that);
from that token on the sequence takes the Python decodes, from the offsets tracked beside the stream.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None

REPLACEMENT_CHARACTER = "\ufffd"

PROMPT_CONTEXT_TOKENS = 6
"""Prompt tokens kept as decoding context (vLLM uses its initial offset of 5 plus a margin)."""


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas; one instance per output sequence.

    ``spaces_between_special_tokens`` is passed to ``decode`` of slow (pure Python) tokenizers only,
    as in vLLM; fast tokenizers decode special tokens without inserting spaces, and transformers 5
    accepts but ignores the option for slow ones too, so today it has no effect.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_options: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        if not getattr(tokenizer, "is_fast", True):
            self._decode_options["spaces_between_special_tokens"] = spaces_between_special_tokens
        context = self._prompt_context(list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._token_ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._output_text_parts: list[str] = []
        self._backend = streaming_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            if context:
                # One step over the whole context: its text counts as emitted, and the window starts
                # at its first token, as the offsets above say.
                try:
                    self._stream.step(self._backend, context)
                except Exception:  # refused: the Python decodes from the start
                    self._stream = None

    def _prompt_context(self, prompt_tail: list[int]) -> list[int]:
        """The prompt tail used as context, or none when it ends inside a UTF-8 character.

        A prompt cut mid-character (possible with token-id prompts) would merge its bytes with the
        output's; the output is then decoded on its own, as ``tokenizer.decode(output_ids)`` does.
        """
        if self._decode(prompt_tail).endswith(REPLACEMENT_CHARACTER):
            return []
        return prompt_tail

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, **self._decode_options)

    def append(self, token_ids: Sequence[int]) -> str:
        """Add generated token ids; return the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        if self._stream is not None:
            return self._append_streamed([int(token_id) for token_id in token_ids])
        self._token_ids.extend(int(token_id) for token_id in token_ids)
        return self._append_decoded()

    def _append_streamed(self, token_ids: list[int]) -> str:
        """append() through DecodeStream, one token at a time; the Python decodes once it refuses one."""
        pieces = []
        for index, token_id in enumerate(token_ids):
            self._token_ids.append(token_id)
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # the stream refused the window (its InvalidPrefix error): decode in Python
                self._stream = None
                self._token_ids.extend(token_ids[index + 1:])
                pieces.append(self._append_decoded())
                break
            if piece is not None:
                pieces.append(self._emit(piece))
        return "".join(pieces)

    def _append_decoded(self) -> str:
        """The text the tokens since the read offset complete, by decoding the window in Python."""
        emitted_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(window_text) <= len(emitted_text) or window_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._emit(window_text[len(emitted_text) :])

    def _emit(self, delta: str) -> str:
        """Record `delta` as emitted: the window moves to the old read offset, the read offset to the end."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._output_text_parts.append(delta)
        return delta

    def clone(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (for a forked sequence)."""
        twin = copy.copy(self)
        twin._token_ids = list(self._token_ids)
        twin._stream = copy.deepcopy(self._stream) if self._stream is not None else None
        twin._output_text_parts = list(self._output_text_parts)
        return twin

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned by ``append``)."""
        if len(self._output_text_parts) > 1:
            self._output_text_parts = ["".join(self._output_text_parts)]
        return self._output_text_parts[0] if self._output_text_parts else ""


def streaming_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer that DecodeStream can decode `tokenizer`'s ids with, or None.

    Only where transformers' ``decode`` returns the backend's text unchanged: a fast tokenizer that
    does not clean up spaces, and a tokenizers release whose DecodeStream takes a list of ids.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or not getattr(tokenizer, "is_fast", False)
            or getattr(tokenizer, "clean_up_tokenization_spaces", False) or not _stream_takes_lists()):
        return None
    return backend


@functools.cache
def _stream_takes_lists() -> bool:
    """Whether this tokenizers release has a DecodeStream whose step takes a list of ids (older ones take one)."""
    if DecodeStream is None:
        return False
    from tokenizers import Tokenizer, models

    probe = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    try:
        return DecodeStream(skip_special_tokens=True).step(probe, [0, 0]) == probe.decode([0, 0])
    except TypeError:
        return False
