"""End to end: tiny fp32 artifacts run by LLMEngine on the cpu backend match the torch backend step by step.

Steps mix decodes, whole prefills and prefill chunks (a token budget below the longest prompt);
the logits of every step agree within 1e-5 (float32 rounding through a few layers: the kernels
sum in other orders than the torch kernels) and so do the greedy tokens. The tiny mistral (a llama
with a sliding window) has a window shorter than the longest sequences.
"""

from __future__ import annotations

import torch

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full

PROMPT_LENGTHS = [5, 23, 1, 40, 12]
MAX_TOKENS = [4, 3, 5, 8, 2]
TOKEN_BUDGET = 16


def engine(artifact, backend: str) -> LLMEngine:
    return LLMEngine(artifact, EngineConfig(backend=backend, device="cpu", num_kv_blocks=48, max_num_seqs=8,
                                            max_num_batched_tokens=TOKEN_BUDGET))


def test_cpu_backend_matches_torch_backend_step_by_step(tiny_artifact, cpu_kernels, one_thread):
    artifact = tiny_artifact("mistral")
    reference, native = engine(artifact, "torch"), engine(artifact, "cpu")
    assert native.backend == "cpu"
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49000, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]
    for each in (reference, native):
        for prompt, max_tokens in zip(prompts, MAX_TOKENS, strict=True):
            each.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    worst, mixed_steps = 0.0, 0
    while reference.has_unfinished_requests():
        expected = {output.request_id: output for output in reference.step()}
        actual = {output.request_id: output for output in native.step()}
        worst = max(worst, (reference.last_step.logits - native.last_step.logits).abs().max().item())
        lengths = [item.num_new_tokens for item in native.last_step.schedule.scheduled]
        mixed_steps += 1 in lengths and max(lengths) > 1
        assert actual.keys() == expected.keys()
        for request_id, output in expected.items():
            assert actual[request_id].outputs[0].token_ids == output.outputs[0].token_ids
    assert not native.has_unfinished_requests()
    assert worst <= 1e-5, f"max abs logits difference {worst}"
    assert mixed_steps > 0, "no step mixed decodes with prefills"
    assert_pool_full(native)
