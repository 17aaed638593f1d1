"""The json_schema workload: its schema constrains every request, its twins match the constrained lengths, and
validity counts what parses and what the schema accepts (jsonschema, with formats checked)."""

from __future__ import annotations

import json

from octavo.bench.structured import constrained_params, unconstrained_twins, validity
from octavo.bench.workloads import get_workload

RECORD = {"name": "Ada", "age": 36, "email": "ada@math.org", "active": True, "plan": "pro", "balance": -5,
          "tags": ["math"], "address": {"city": "London", "country": "GB"}, "signup_date": "1843-07-01",
          "notes": None}


def test_the_workload_constrains_every_request_to_its_ten_field_schema(smollm2_source):
    workload = get_workload("json_schema")
    schema = workload.schema()
    assert len(schema["properties"]) == 10 and sorted(schema["required"]) == sorted(schema["properties"])
    params = constrained_params(workload, 3)
    assert len(params) == 3 and all(p.structured.kind == "json" and p.max_tokens == workload.output_len for p in params)
    assert len(workload.prompts(49152, smollm2_source.tokenizer)) == workload.num_requests
    assert constrained_params(get_workload("throughput"), 3) is None
    assert [p.max_tokens for p in unconstrained_twins([[1, 2, 3], [4], []])] == [3, 1, 1]
    assert all(p.structured is None and p.ignore_eos for p in unconstrained_twins([[1]]))


def test_validity_parses_then_checks_the_schema_and_its_formats(smollm2_source):
    tokenizer = smollm2_source.tokenizer
    workload = get_workload("json_schema")
    bad_date = {**RECORD, "signup_date": "July 1843"}
    outputs = [tokenizer.encode(text, add_special_tokens=False)
               for text in (json.dumps(RECORD), json.dumps(bad_date), json.dumps(RECORD)[:-1])]
    assert validity(workload, outputs, tokenizer) == "2/3 parse as JSON, 1/3 valid under the schema"
