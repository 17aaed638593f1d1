"""Offline English text: the Python standard library's module docstrings, and reading user text files.

(The other kinds of text and the calibration mix: octavo.eval.kinds; text by name: octavo.eval.sources.)

The default text needs no download and is on every machine: the docstrings at the top of
the standard library's own source files (read as literals with the tokenizer, never by
importing a module), in sorted path order, each at least MIN_DOCSTRING_CHARS long, joined
by blank lines. Tests, the Tk GUI (idlelib, turtledemo) and lib2to3 are left out. Module i
of that order goes to the calibration part when ``i % CALIBRATION_EVERY == CALIBRATION_EVERY - 1``
and to the evaluation part otherwise, so the two parts share no module. The text depends
on the Python version (its standard library); its sha256 is reported with every result.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import sysconfig
import tokenize
from pathlib import Path

from octavo.errors import OctavoError

PARTS = ("calibration", "evaluation")
MIN_DOCSTRING_CHARS = 100
CALIBRATION_EVERY = 4
_SKIPPED_DIRECTORIES = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages", "__pycache__"}
_LEADING_TOKENS = {tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE}


def default_text(part: str) -> str:
    """The calibration or evaluation part of the standard library text."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    docstrings = stdlib_docstrings()
    chosen = [text for index, (_, text) in enumerate(docstrings)
              if (index % CALIBRATION_EVERY == CALIBRATION_EVERY - 1) == (part == "calibration")]
    return "\n\n".join(chosen)


@functools.cache
def stdlib_docstrings() -> tuple[tuple[str, str], ...]:
    """(relative path, module docstring) of every standard library source file that has a long enough one."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED_DIRECTORIES.intersection(relative.parts):
            continue
        docstring = module_docstring(path)
        if docstring and len(docstring) >= MIN_DOCSTRING_CHARS:
            found.append((relative.as_posix(), docstring))
    return tuple(found)


def module_docstring(path: Path) -> str | None:
    """The docstring of a Python source file: its first statement when that is a string literal."""
    try:
        with open(path, "rb") as handle:
            for token in tokenize.tokenize(handle.readline):
                if token.type in _LEADING_TOKENS:
                    continue
                if token.type != tokenize.STRING:
                    return None
                value = ast.literal_eval(token.string)
                return value.strip() if isinstance(value, str) else None
    except (OSError, SyntaxError, ValueError, tokenize.TokenError):
        return None
    return None


def read_text_file(source: str) -> str:
    """Text from a file of plain text or JSONL.

    A JSONL file (suffix .jsonl, or every non-empty line a JSON object) contributes the
    "text" field of each line, joined by blank lines.
    """
    path = Path(source).expanduser()
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise OctavoError(f"cannot read text file {path}: {error}") from error
    lines = [line for line in content.splitlines() if line.strip()]
    if path.suffix == ".jsonl" or (lines and all(_is_json_object(line) for line in lines)):
        return _jsonl_text(path, lines)
    if not content.strip():
        raise OctavoError(f"text file {path} is empty")
    return content


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _jsonl_text(path: Path, lines: list[str]) -> str:
    texts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as error:
            raise OctavoError(f"{path} line {number} is not JSON: {error}") from error
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise OctavoError(f"{path} line {number} has no \"text\" string field")
        texts.append(record["text"])
    if not texts:
        raise OctavoError(f"JSONL file {path} has no lines")
    return "\n\n".join(texts)


def _is_json_object(line: str) -> bool:
    return line.lstrip().startswith("{") and line.rstrip().endswith("}")
