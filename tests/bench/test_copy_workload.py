"""The `copy` workload: real chat requests (reproduce given code with one edit) in the model's chat template."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from octavo.bench.workloads import get_workload, workloads_path
from octavo.errors import OctavoError


def test_copy_prompts_are_the_chat_requests_rendered_by_the_template(smollm2_source):
    tokenizer = smollm2_source.tokenizer
    workload = get_workload("copy")
    with open(workloads_path().parent / workload.chat_file, "rb") as handle:
        requests = tomllib.load(handle)["request"]
    prompts = workload.prompts(len(tokenizer), tokenizer)
    assert len(prompts) == workload.num_requests == len(requests)
    for prompt, request in zip(prompts, requests, strict=True):
        text = tokenizer.decode(prompt)
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert request["instruction"] in text and request["code"].strip() in text
    more = dataclasses.replace(workload, num_requests=10).prompts(len(tokenizer), tokenizer)
    assert more[8:] == prompts[:2]  # more requests than tables: again from the first


def test_copy_workload_needs_a_tokenizer_with_a_chat_template():
    with pytest.raises(OctavoError, match="copy is made of chat requests"):
        get_workload("copy").prompts(49152)
