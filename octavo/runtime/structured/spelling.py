"""Which texts a vocabulary can write: a fixed output (a choice) is only reachable if some sequence of
the vocabulary's tokens spells its UTF-8 bytes exactly.

Byte-level vocabularies need not hold every byte: SmolLM2's has no token for byte 0x1d or for the
lead byte 0xf2, so a choice containing U+001D or U+AC60C can never be written, and the grammar
engine's masks reach a state that allows no token at all. Such a choice is refused when the request
arrives, naming it, instead of failing mid-generation.
"""

from __future__ import annotations


class Spelling:
    """The byte strings of a vocabulary's ordinary tokens (special tokens never spell text)."""

    def __init__(self, decoded_vocab: list[bytes], special_token_ids: list[int]):
        special = set(special_token_ids)
        self.pieces = {piece for index, piece in enumerate(decoded_vocab) if piece and index not in special}
        self.longest = max((len(piece) for piece in self.pieces), default=0)

    def first_unwritable(self, text: str) -> int | None:
        """None when tokens spell `text` exactly, else the index of the first character past the longest
        prefix that tokens can spell (dynamic programming over the byte offsets)."""
        data = text.encode("utf-8")
        reachable = [False] * (len(data) + 1)
        reachable[0] = True
        furthest = 0
        for start in range(len(data)):
            if not reachable[start]:
                continue
            for end in range(start + 1, min(len(data), start + self.longest) + 1):
                if not reachable[end] and data[start:end] in self.pieces:
                    reachable[end] = True
                    furthest = max(furthest, end)
        if reachable[len(data)]:
            return None
        return len(data[:furthest].decode("utf-8", errors="ignore"))
