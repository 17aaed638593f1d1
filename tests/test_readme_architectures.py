"""README's list of supported architectures is the one generated from what the tests cover."""

from __future__ import annotations

from octavo.frontend.architectures import ARCHITECTURES
from tests.readme_architectures import README, architecture_table, readme_block
from tests.tiny_models import TINY_MODELS


def test_every_architecture_in_the_table_is_tested():
    assert set(ARCHITECTURES) == set(TINY_MODELS)


def test_readme_lists_what_the_tests_cover():
    assert readme_block(README.read_text()) == architecture_table(), (
        "README.md's architecture list is stale: run `python -m tests.readme_architectures`")
