"""End to end: tiny artifacts run through LLMEngine on the triton backend match the torch backend."""

from __future__ import annotations

import pytest
import torch

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full

PROMPT_LENGTHS = [5, 23, 1, 12]
MAX_TOKENS = [5, 4, 6, 3]
TOKEN_BUDGET = 16  # smaller than the longest prompt: steps mix decodes, whole prefills and prefill chunks


def engine(artifact, backend: str, device: torch.device) -> LLMEngine:
    return LLMEngine(artifact, EngineConfig(backend=backend, device=device.type, num_kv_blocks=32, max_num_seqs=8,
                                            max_num_batched_tokens=TOKEN_BUDGET))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_triton_backend_matches_torch_backend_step_by_step(model_type, tiny_artifact, device):
    artifact = tiny_artifact(model_type)
    reference, triton_engine = engine(artifact, "torch", device), engine(artifact, "triton", device)
    assert triton_engine.backend == "triton"
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49000, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]
    for each in (reference, triton_engine):
        for prompt, max_tokens in zip(prompts, MAX_TOKENS, strict=True):
            each.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    worst, mixed_steps, outputs = 0.0, 0, {}
    while reference.has_unfinished_requests():
        expected = {output.request_id: output for output in reference.step()}
        actual = {output.request_id: output for output in triton_engine.step()}
        worst = max(worst, (reference.last_step.logits - triton_engine.last_step.logits).abs().max().item())
        lengths = [item.num_new_tokens for item in triton_engine.last_step.schedule.scheduled]
        mixed_steps += 1 in lengths and max(lengths) > 1
        assert actual.keys() == expected.keys()
        outputs.update(actual)
        for request_id, output in expected.items():
            assert actual[request_id].outputs[0].token_ids == output.outputs[0].token_ids
    assert not triton_engine.has_unfinished_requests()
    assert worst <= 1e-4, f"max abs logits difference {worst}"
    assert mixed_steps > 0, "no step mixed decodes with prefills"
    assert [len(outputs[str(index)].outputs[0].token_ids) for index in range(len(prompts))] == MAX_TOKENS
    assert_pool_full(triton_engine)
