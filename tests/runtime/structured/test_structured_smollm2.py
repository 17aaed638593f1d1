"""The bundled SmolLM2 under the benchmark's 10-field JSON schema: every output of a batch of concurrent chat
requests parses and validates against the schema (jsonschema, formats checked), greedy and sampled."""

from __future__ import annotations

import json

import jsonschema
import pytest

from octavo.bench.workloads import get_workload
from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured.spec import StructuredOutputs

pytestmark = pytest.mark.slow

NUM_REQUESTS = 8


def test_concurrent_chat_requests_all_validate(smollm2_fp32_artifact):
    workload = get_workload("json_schema")
    schema = workload.schema()
    llm = LLM(smollm2_fp32_artifact, num_kv_blocks=256, max_num_seqs=NUM_REQUESTS)
    prompts = workload.prompts(llm.engine.vocab_size, llm.tokenizer)[:NUM_REQUESTS]
    spec = StructuredOutputs(json=schema)
    params = [SamplingParams(temperature=0, max_tokens=workload.output_len, structured=spec)] * (NUM_REQUESTS // 2)
    params += [SamplingParams(temperature=0.8, seed=index, max_tokens=workload.output_len, structured=spec)
               for index in range(NUM_REQUESTS // 2)]
    outputs = llm.generate(prompts, params)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        validator.validate(json.loads(completion.text))
    assert llm.engine.structured.grammars.compilations == 1
