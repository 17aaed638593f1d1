"""The structured-output benchmark: a workload whose requests are constrained to a JSON schema.

`octavo bench A --workload json_schema` runs the workload's requests each constrained to its schema
(greedy, stopping when the JSON is complete) and reports how many outputs parse as JSON and how many
the schema accepts (`jsonschema`, independent of the grammar engine). `--vs unconstrained` then runs
the same prompts without the schema, each generating exactly as many tokens as its constrained twin
did, so that both runs compute the same token counts at the same context lengths and the ratio of
their throughputs is the cost of the constraint alone.
"""

from __future__ import annotations

import json

from octavo.bench.runners import bench_params
from octavo.bench.workloads import Workload
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured import StructuredOutputs


def constrained_params(workload: Workload, num_requests: int) -> list[SamplingParams] | None:
    """Greedy parameters constrained to the workload's schema (None for a workload without one)."""
    schema = workload.schema()
    if schema is None:
        return None
    params = bench_params(workload.output_len)
    params.structured = StructuredOutputs(json=schema)
    return [params] * num_requests


def unconstrained_twins(outputs: list[list[int]]) -> list[SamplingParams]:
    """Unconstrained greedy parameters producing as many tokens as each constrained output had."""
    return [bench_params(max(1, len(tokens))) for tokens in outputs]


def validity(workload: Workload, outputs: list[list[int]], tokenizer) -> str:
    """"P/N parse as JSON, V/N valid under the schema" for the outputs (token ids) of the constrained run."""
    import jsonschema

    schema = workload.schema()
    parsed = valid = 0
    for tokens in outputs:
        try:
            value = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
        except ValueError:
            continue
        parsed += 1
        if jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(value):
            valid += 1
    return f"{parsed}/{len(outputs)} parse as JSON, {valid}/{len(outputs)} valid under the schema"
