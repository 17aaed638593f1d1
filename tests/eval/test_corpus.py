"""The offline text: standard library docstrings split into calibration and evaluation, and user text files."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import pytest

from octavo.errors import OctavoError
from octavo.eval.corpus import default_text, module_docstring, read_text_file, stdlib_docstrings


def test_parts_are_disjoint_deterministic_english_text():
    calibration, evaluation = default_text("calibration"), default_text("evaluation")
    documents = [text for _, text in stdlib_docstrings()]
    assert calibration == "\n\n".join(documents[3::4])  # every fourth module
    assert evaluation == "\n\n".join(text for index, text in enumerate(documents) if index % 4 != 3)
    assert len(evaluation) > 2 * len(calibration) > 20_000
    assert evaluation.count(" the ") > 500


def test_docstrings_are_read_without_importing(tmp_path):
    module = tmp_path / "explodes.py"
    module.write_text('# comment\n"""The docstring, as ast sees it."""\nraise SystemExit("imported!")\n')
    assert module_docstring(module) == "The docstring, as ast sees it."
    (tmp_path / "none.py").write_text("x = 1\n")
    assert module_docstring(tmp_path / "none.py") is None


def test_the_docstrings_are_ast_s_in_sorted_path_order():
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [path for path, _ in stdlib_docstrings()]
    assert paths == sorted(paths) and "ast.py" in paths
    for path, text in stdlib_docstrings()[:20]:
        tree = ast.parse((root / path).read_text(encoding="utf-8"))
        assert ast.get_docstring(tree, clean=False).strip() == text


def test_text_and_jsonl_files(tmp_path):
    plain = tmp_path / "notes.txt"
    plain.write_text("Some text.\n{not json}\n")
    assert read_text_file(str(plain)) == "Some text.\n{not json}\n"
    records = tmp_path / "data.jsonl"
    records.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n")
    assert read_text_file(str(records)) == "first\n\nsecond"


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bad.jsonl", '{"content": "no text field"}\n', 'has no "text" string field'),
    ("broken.jsonl", '{"text": "a"}\nnot json\n', "line 2 is not JSON"),
    ("empty.txt", "  \n", "is empty"),
])
def test_bad_files_name_what_is_wrong(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(OctavoError, match=message):
        read_text_file(str(tmp_path / name))
    with pytest.raises(OctavoError, match="cannot read text file"):
        read_text_file(str(tmp_path / "missing.txt"))
