"""Text by name: the built-in texts (``default`` and the kinds of octavo.eval.kinds) or a user's file.

``default`` is the built-in evaluation text (the ``docs`` kind's evaluation part); ``docs``, ``code``,
``reference`` and ``prose`` are each kind's evaluation part, text the default calibration never saw.
The default calibration text is the kinds' calibration mix.
"""

from __future__ import annotations

from octavo.eval.corpus import read_text_file
from octavo.eval.kinds import KINDS, calibration_mix, kind_text

BUILTIN_NAMES = ("default", *KINDS)


def read_text(source: str) -> str:
    """An evaluation text: a built-in name (BUILTIN_NAMES) or a file of plain text or JSONL."""
    if source in BUILTIN_NAMES:
        return kind_text("docs" if source == "default" else source, "evaluation")
    return read_text_file(source)


def calibration_text(source: str | None) -> str:
    """The calibration text: the calibration mix of every kind (None or "default") or a user's file."""
    return calibration_mix() if source in (None, "default") else read_text_file(source)
