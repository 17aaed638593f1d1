"""A lower bound on a text's token count from its characters, so that hopeless prompts skip the tokenizer.

Every token is a vocabulary string; let K be the longest one (added and special tokens included),
read from the vocabulary at load. The bound holds for tokenizers that only *map* input characters
to one or more vocabulary characters, never merge or delete them:

- byte-level BPE writes each input byte as one vocabulary character (a character is 1-4 bytes);
- Metaspace writes a space as "▁" (one for one) and may prepend one;
- byte fallback spells an unknown character as byte tokens; a BPE model with `fuse_unk` off emits
  one unknown token per unknown character.

Then every kept input character puts at least one vocabulary character into some token, and a
token holds at most K of them: a text with C kept characters needs at least ceil(C / K) tokens.
Byte-level BPE silently drops a byte that is not in its vocabulary; SmolLM2's lacks six ASCII
control characters, so those count as dropped (`droppable`). A multi-byte character always keeps
its continuation bytes when all 64 are in the vocabulary, which is required.

A normalizer or pre-tokenizer that can drop or merge characters (Unicode normalization, whitespace
splitting, stripping) or a model that can swallow many characters into one unknown token breaks
the argument: `CharacterBound.of` returns None for such tokenizers and no bound is applied.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_MAPPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})
_CONTINUATION_BYTES = range(0x80, 0xC0)


@dataclass(frozen=True)
class CharacterBound:
    """No token covers more than `max_chars_per_token` input characters; `droppable` ones may vanish."""

    max_chars_per_token: int
    droppable: str = ""

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` can encode to (special tokens the tokenizer adds come on top)."""
        kept = len(text) - sum(text.count(char) for char in self.droppable)
        return math.ceil(kept / self.max_chars_per_token)

    @classmethod
    def of(cls, tokenizer: Any) -> CharacterBound | None:
        """The bound of a Hugging Face fast tokenizer, or None when it cannot be justified (module docstring)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            logger.info("no prompt length bound from characters: not a fast tokenizer")
            return None
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
        reason = _unmapped_reason(spec)
        droppable = _droppable(spec, vocab)
        if reason is None and droppable is None:
            reason = "unknown characters may be dropped or merged into one token"
        if reason is not None:
            logger.info("no prompt length bound from characters: %s", reason)
            return None
        return cls(max(len(token) for token in vocab), droppable)


def _unmapped_reason(spec: dict) -> str | None:
    if not _keeps_characters_normalizer(spec.get("normalizer")):
        return f"the normalizer {spec['normalizer'].get('type')} may remove characters"
    if not _keeps_characters_pre_tokenizer(spec.get("pre_tokenizer")):
        return f"the pre-tokenizer {spec['pre_tokenizer'].get('type')} may remove characters"
    return None


def _droppable(spec: dict, vocab: dict[str, int]) -> str | None:
    """Characters the model may drop; None when unknown characters may vanish or merge beyond that."""
    model = spec.get("model") or {}
    if model.get("byte_fallback") and all(f"<0x{byte:02X}>" in vocab for byte in range(256)):
        return ""
    if _is_byte_level(spec.get("pre_tokenizer")):
        alphabet = _byte_alphabet()
        if any(alphabet[byte] not in vocab for byte in _CONTINUATION_BYTES):
            return None
        return "".join(chr(byte) for byte in range(0x80) if alphabet[byte] not in vocab)
    if model.get("type") == "BPE" and model.get("unk_token") is not None and not model.get("fuse_unk"):
        return ""
    return None


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's byte -> character map (printable Latin-1 bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in alphabet)
    for offset, byte in enumerate(shifted):
        alphabet[byte] = chr(256 + offset)
    return alphabet


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(item) for item in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def _keeps_characters_normalizer(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters_normalizer(item) for item in normalizer.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"]) > 0
    return False


def _keeps_characters_pre_tokenizer(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters_pre_tokenizer(item) for item in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _MAPPING_PRE_TOKENIZERS
