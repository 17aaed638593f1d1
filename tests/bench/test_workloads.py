"""The benchmark workloads draw exactly the prompts the side-by-side harness of the other engines draws.

The expected figures (request count, total prompt tokens, the first ids and a sha256 of the JSON
list of prompt id lists) were produced by the harness's own generator, outside this repository:
`python workload.py NAME` (a list of {"prompt_token_ids", "max_tokens"}), hashed with
`hashlib.sha256(json.dumps([r["prompt_token_ids"] for r in requests]).encode())`. Matching them means
that Octavo and vLLM, OpenVINO GenAI, llama.cpp and HF run the very same token ids.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from octavo.bench.workloads import get_workload, workload_from_file
from octavo.errors import OctavoError

SMOLLM2_VOCAB = 49152
HARNESS = {
    # name: (requests, prompt tokens, max_tokens, first five ids, sha256 of the id lists)
    "throughput": (64, 18717, 128, [25347, 27662, 2753, 17068, 33606],
                   "82cb3c0e3a9b72b6806111b2b57d61ff85326df7af39a0f8cb47bf15a70d54e2"),
    "single": (1, 256, 128, [37403, 4235, 16816, 7827, 32568],
               "8cef9f4afbbbba83985fef936d589207a55f3b2b3c8dbca0fd06f95b86469f2c"),
    "shared_prefix": (32, 14509, 64, [3806, 6102, 5662, 23762, 11181],
                      "029a28edefe8bc877a6a22916ecaca5a08f935741367a36b308779bac9aa4015"),
}


@pytest.mark.parametrize("name", sorted(HARNESS))
def test_workload_prompts_equal_the_harness_generator(name):
    requests, prompt_tokens, max_tokens, first_ids, digest = HARNESS[name]
    workload = get_workload(name)
    prompts = workload.prompts(SMOLLM2_VOCAB)
    assert (len(prompts), sum(map(len, prompts)), workload.output_len) == (requests, prompt_tokens, max_tokens)
    assert prompts[0][:5] == first_ids
    assert hashlib.sha256(json.dumps(prompts).encode()).hexdigest() == digest


def test_shared_prefix_workload_shares_its_prefix():
    prompts = get_workload("shared_prefix").prompts(SMOLLM2_VOCAB)
    assert all(prompt[:384] == prompts[0][:384] for prompt in prompts)
    assert len({tuple(prompt[384:]) for prompt in prompts}) == len(prompts)


def test_small_vocabulary_keeps_ids_inside_it():
    prompts = get_workload("throughput").prompts(1000)
    assert all(100 <= token < 1000 for prompt in prompts for token in prompt)


def test_prompts_from_file_round_trip(tmp_path):
    requests = [{"prompt_token_ids": [5, 6, 7], "max_tokens": 9}, {"prompt_token_ids": [8], "max_tokens": 9}]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(requests))
    workload = workload_from_file(path)
    assert workload.prompts(SMOLLM2_VOCAB) == [[5, 6, 7], [8]]
    assert (workload.name, workload.num_requests, workload.output_len) == ("mine", 2, 9)


@pytest.mark.parametrize(("content", "message"), [
    ("not json", "not valid JSON"),
    ("[]", "non-empty JSON list"),
    ('[{"prompt_token_ids": [1], "max_tokens": 0}]', "request 0 must be"),
    ('[{"prompt_token_ids": [1], "max_tokens": 2}, {"prompt_token_ids": [1], "max_tokens": 3}]',
     "different max_tokens"),
])
def test_prompts_from_file_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(OctavoError, match=message):
        workload_from_file(path)


def test_prompts_from_file_rejects_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps([{"prompt_token_ids": [1, 50000], "max_tokens": 4}]))
    with pytest.raises(OctavoError, match="token id 50000"):
        workload_from_file(path).prompts(SMOLLM2_VOCAB)
