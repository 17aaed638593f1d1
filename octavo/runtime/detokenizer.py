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
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

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
        self._token_ids.extend(int(token_id) for token_id in token_ids)
        emitted_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(window_text) <= len(emitted_text) or window_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        delta = window_text[len(emitted_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._output_text_parts.append(delta)
        return delta

    def clone(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (for a forked sequence)."""
        twin = copy.copy(self)
        twin._token_ids = list(self._token_ids)
        twin._output_text_parts = list(self._output_text_parts)
        return twin

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned by ``append``)."""
        if len(self._output_text_parts) > 1:
            self._output_text_parts = ["".join(self._output_text_parts)]
        return self._output_text_parts[0] if self._output_text_parts else ""
