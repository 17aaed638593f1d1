"""Texts of several kinds: calibration and evaluation parts that share nothing, and the calibration mix."""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import pytest

from octavo.eval.corpus import default_text, stdlib_docstrings
from octavo.eval.kinds import KINDS, PIECE_CHARS, calibration_mix, identifying_lines, kind_text, split_pieces
from octavo.eval.sources import BUILTIN_NAMES, calibration_text, read_text

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.mark.parametrize("kind", KINDS)
def test_no_evaluation_line_is_in_the_calibration_mix(kind):
    """Held out: no identifying line of a kind's evaluation part appears in the default calibration text."""
    evaluation = kind_text(kind, "evaluation")
    assert len(evaluation) > 10_000
    assert not identifying_lines(evaluation) & identifying_lines(calibration_text(None))


def test_the_mix_deals_every_kind_in_turn():
    """Its pieces come from the kinds in turn (docs, code, reference, prose, docs, ...) while each kind lasts; every
    kind keeps most of its pieces, whatever it shares with an evaluation part being left out."""
    mix = calibration_mix()
    assert calibration_text("default") == mix
    owner = {piece: kind for kind in KINDS for piece in split_pieces(kind_text(kind, "calibration"), PIECE_CHARS)}
    kept = {kind: [piece for piece, owned in owner.items() if owned == kind and piece in mix] for kind in KINDS}
    for kind in KINDS:
        total = sum(owned == kind for owned in owner.values())
        assert len(kept[kind]) >= total / 2, (kind, len(kept[kind]), total)
    first_round = [kept[kind][0] for kind in KINDS]
    assert mix.startswith("\n\n".join(first_round))
    positions = sorted((mix.index(piece), kind) for kind in KINDS for piece in kept[kind][:3])
    assert [kind for _, kind in positions] == list(KINDS) * 3  # three full rounds


def test_code_is_the_source_of_the_docs_modules_of_the_same_part():
    documents = stdlib_docstrings()
    calibration_modules = [path for index, (path, _) in enumerate(documents) if index % 4 == 3]
    code = kind_text("code", "calibration")
    assert (STDLIB / calibration_modules[0]).read_text(encoding="utf-8") in code
    evaluation_modules = [path for index, (path, _) in enumerate(documents) if index % 4 != 3]
    assert (STDLIB / evaluation_modules[0]).read_text(encoding="utf-8") in kind_text("code", "evaluation")
    assert "def " in code and "import " in code


def test_reference_topics_are_the_language_reference():
    tree = ast.parse((STDLIB / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    topics = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign))
    names = sorted(topics)
    assert topics[names[3]].strip() in kind_text("reference", "calibration")
    assert topics[names[0]].strip() in kind_text("reference", "evaluation")


def test_builtin_names_read_each_kinds_evaluation_part(tmp_path):
    assert read_text("default") == default_text("evaluation") == read_text("docs")
    for name in BUILTIN_NAMES[1:]:
        assert read_text(name) == kind_text(name, "evaluation")
    assert read_text("prose").count(" the ") > 100
    own = tmp_path / "calibration.txt"
    own.write_text("my own text")
    assert calibration_text(str(own)) == "my own text" and read_text(str(own)) == "my own text"


def test_unknown_kinds_and_parts_are_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        kind_text("poetry", "evaluation")
    with pytest.raises(ValueError, match="part must be one of"):
        kind_text("code", "training")
