"""Offline texts of several kinds, each in a calibration and an evaluation part that share nothing, and their mix.

Kinds (every source is on every machine that runs Octavo, and freely licensed):

- ``docs``: the standard library's module docstrings (corpus.default_text; its evaluation part is the
  built-in evaluation text, ``default``);
- ``code``: the standard library's Python source of the same modules, split the same way (a module's
  docstring and its code fall on the same side), up to CODE_CHARS characters a part;
- ``reference``: the Python language reference's topics the standard library ships for ``help()``
  (pydoc_data/topics.py, read as a literal, never imported), every CALIBRATION_EVERY-th topic of the
  sorted names for calibration;
- ``prose``: English prose written for this project (octavo/eval/texts/: essays, a letter, stories),
  one text per part.

The calibration mix (the default calibration text) deals pieces of about PIECE_CHARS characters from
every kind's calibration part in turn (docs, code, reference, prose, docs, ...), so that any prefix of
it (the calibrated schemes run on its first tokens) holds every kind in about equal shares until the
shortest part runs out. Every evaluation part is held out from it: the parts split different modules
and topics, but the standard library repeats itself (modules quote each other's docstrings, reference
topics each other's grammar), so a piece that shares any line of IDENTIFYING_LINE_CHARS or more
characters with an evaluation part of any kind is left out of the mix.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

from octavo.eval.corpus import CALIBRATION_EVERY, default_text, stdlib_docstrings

KINDS = ("docs", "code", "reference", "prose")
PARTS = ("calibration", "evaluation")
CODE_CHARS = 200_000
PIECE_CHARS = 2_000
IDENTIFYING_LINE_CHARS = 40
TEXTS_DIR = Path(__file__).parent / "texts"


def kind_text(kind: str, part: str) -> str:
    """The `part` ("calibration" or "evaluation") of one kind of text."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if kind == "docs":
        return default_text(part)
    if kind == "code":
        return _joined(_stdlib_code(part), CODE_CHARS)
    if kind == "reference":
        return "\n\n".join(text for index, (_, text) in enumerate(_reference_topics())
                           if _is_calibration(index) == (part == "calibration"))
    return (TEXTS_DIR / f"prose_{part}.txt").read_text(encoding="utf-8")


@functools.cache
def calibration_mix() -> str:
    """The kinds' calibration parts dealt in pieces of about PIECE_CHARS characters, one kind after another, without
    the pieces that share a line with an evaluation part (see the module docstring)."""
    held_out = set().union(*(identifying_lines(kind_text(kind, "evaluation")) for kind in KINDS))
    pieces = [[piece for piece in split_pieces(kind_text(kind, "calibration"), PIECE_CHARS)
               if not identifying_lines(piece) & held_out] for kind in KINDS]
    dealt = []
    for round_index in range(max(map(len, pieces))):
        dealt.extend(kind_pieces[round_index] for kind_pieces in pieces if round_index < len(kind_pieces))
    return "\n\n".join(dealt)


def identifying_lines(text: str) -> set[str]:
    """The lines of `text` long enough to tell where they come from (stripped; short ones recur anywhere)."""
    return {stripped for line in text.splitlines() if len(stripped := line.strip()) >= IDENTIFYING_LINE_CHARS}


def split_pieces(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of at least `size` characters (the last may be shorter)."""
    pieces, current, length = [], [], 0
    for line in text.splitlines():
        current.append(line)
        length += len(line) + 1
        if length >= size:
            pieces.append("\n".join(current).strip("\n"))
            current, length = [], 0
    if any(line.strip() for line in current):
        pieces.append("\n".join(current).strip("\n"))
    return [piece for piece in pieces if piece.strip()]


def _is_calibration(index: int) -> bool:
    return index % CALIBRATION_EVERY == CALIBRATION_EVERY - 1


def _stdlib_code(part: str) -> list[str]:
    """The source files of the modules of `part` in corpus.stdlib_docstrings' order and split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / path).read_text(encoding="utf-8", errors="replace")
            for index, (path, _) in enumerate(stdlib_docstrings()) if _is_calibration(index) == (part == "calibration")]


def _joined(documents: list[str], limit: int) -> str:
    """Whole documents joined by blank lines while the total stays within `limit` characters (at least one)."""
    chosen, total = [], 0
    for document in documents:
        if chosen and total + len(document) > limit:
            continue
        chosen.append(document)
        total += len(document) + 2
    return "\n\n".join(chosen)


@functools.cache
def _reference_topics() -> tuple[tuple[str, str], ...]:
    """(name, text) of the language reference topics in pydoc_data/topics.py, sorted by name."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    topics = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics")
    return tuple(sorted((name, text.strip()) for name, text in topics.items()))
