"""StructuredOutputs: one kind per spec, types checked with the field named, keys that identify a grammar."""

from __future__ import annotations

import pytest

from octavo.errors import RequestError
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured.spec import GrammarError, StructuredOutputs


def test_exactly_one_kind():
    with pytest.raises(RequestError, match=r"exactly one of .* got none"):
        StructuredOutputs()
    with pytest.raises(RequestError, match="got json, regex"):
        StructuredOutputs(json={"type": "object"}, regex="a")
    assert StructuredOutputs(regex="a+", json_object=False).kind == "regex"


@pytest.mark.parametrize(("fields", "kind", "message"), [
    ({"json": "{not json"}, "json", "its text is not JSON"),
    ({"json": [1, 2]}, "json", "got list"),
    ({"choice": []}, "choice", "non-empty list of strings"),
    ({"choice": ["a", 1]}, "choice", "non-empty list of strings"),
    ({"regex": ""}, "regex", "non-empty string"),
    ({"grammar": 3}, "grammar", "non-empty string"),
    ({"json_object": "yes"}, "json_object", "True or False"),
])
def test_bad_values_name_their_kind(fields, kind, message):
    with pytest.raises(GrammarError, match=message) as caught:
        StructuredOutputs(**fields)
    assert caught.value.kind == kind and f"SamplingParams.structured.{kind}" in str(caught.value)


def test_keys_identify_the_constraint():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_text = StructuredOutputs(json='{"type": "object", "properties": {"b": {"type": "integer"}, '
                                     '"a": {"type": "string"}}}')
    assert StructuredOutputs(json=schema).key == as_text.key
    assert StructuredOutputs(json=schema).key != StructuredOutputs(json=schema, disable_any_whitespace=True).key
    # Property order decides the order the output lists them in: it is part of the key.
    reordered = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert StructuredOutputs(json=reordered).key != StructuredOutputs(json=schema).key
    text = StructuredOutputs(json=schema).schema_text()
    assert text.index('"b"') < text.index('"a"')


def test_sampling_params_take_a_spec_or_its_fields():
    params = SamplingParams(structured={"choice": ["yes", "no"]})
    assert params.structured == StructuredOutputs(choice=["yes", "no"])
    assert params.clone(max_tokens=3).structured.key == params.structured.key
    with pytest.raises(RequestError, match="has no field 'schema'"):
        SamplingParams(structured={"schema": {}})
    with pytest.raises(RequestError, match="StructuredOutputs or a dict"):
        SamplingParams(structured="json")
