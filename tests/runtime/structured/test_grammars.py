"""GrammarCache: xgrammar's rejections as GrammarError naming the kind; one compilation per distinct spec."""

from __future__ import annotations

import threading

import pytest

from octavo.runtime.structured.grammars import GrammarCache
from octavo.runtime.structured.spec import GrammarError, StructuredOutputs


@pytest.mark.parametrize(("fields", "kind", "message"), [
    ({"json": {"type": "wat"}}, "json", 'Unsupported type "wat"'),
    ({"json": {"$ref": "#/definitions/missing"}}, "json", "Cannot find field"),
    ({"json": {"type": "array", "minItems": 3, "maxItems": 1}}, "json", "minItems is greater than maxItems"),
    ({"regex": "a(b"}, "regex", "parenthesis is not closed"),
    ({"regex": "(?=a)a"}, "regex", "Lookahead is not supported"),
    ({"grammar": "root ::= foo"}, "grammar", 'Rule "foo" is not defined'),
    ({"grammar": "start ::= \"a\""}, "grammar", "root"),
])
def test_rejections_name_the_kind_in_one_line(grammars, fields, kind, message):
    with pytest.raises(GrammarError, match=message) as caught:
        grammars.compile(StructuredOutputs(**fields))
    assert caught.value.kind == kind
    text = str(caught.value)
    assert "\n" not in text and ".cc:" not in text, text


def test_a_spec_compiles_once_then_comes_from_the_cache(grammars):
    spec = StructuredOutputs(json={"type": "object", "properties": {"cache_test": {"type": "integer"}}})
    before = grammars.compilations
    first = grammars.compile(spec)
    same_text = StructuredOutputs(json='{"type": "object", "properties": {"cache_test": {"type": "integer"}}}')
    assert grammars.compile(same_text) is first
    assert grammars.compilations == before + 1


def test_threads_share_the_cache(grammars):
    spec = StructuredOutputs(regex="[a-z]{2,5}-threads")
    results = []
    threads = [threading.Thread(target=lambda: results.append(grammars.compile(spec))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and grammars.compile(spec) in results


def test_the_least_recently_used_grammar_is_dropped(tokenizer, grammars):
    small = GrammarCache(tokenizer, grammars.vocab_size, [2], capacity=2)
    small._compiler = grammars.compiler()  # the vocabulary once per test session
    specs = [StructuredOutputs(choice=[f"option {index}"]) for index in range(3)]
    small.compile(specs[0])
    small.compile(specs[1])
    small.compile(specs[0])  # now the most recent
    small.compile(specs[2])  # drops specs[1]
    compiled = small.compilations
    small.compile(specs[0])
    assert small.compilations == compiled
    small.compile(specs[1])
    assert small.compilations == compiled + 1
