"""Every architecture in the table, compiled in fp32, matches HF eager logits step by step.

Five sequences of different lengths run concurrently under a small token
budget, so steps mix decodes, whole prefills and chunks of long prefills,
and requests arrive while others are decoding. Every architecture runs on
the eager executor (node by node); the windowed one (mistral) also on the
compiled executor (AOTInductor, whose decode steps run padded to the
batch-size ladder 1, 2, 4, 8: three to five decoding sequences pad). One
Inductor compile per architecture would cost ~10 s each; the other
architectures differ from it only in ops the compiled executor treats alike
(biases, q/k norms), and tests/runtime/test_compiled_executor.py covers
llama and quantized artifacts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo.config import EngineConfig
from octavo.frontend.architectures import ARCHITECTURES
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.tiny_models import TINY_WINDOW

PROMPT_LENGTHS = [5, 47, 12, 31, 3]
MAX_TOKENS = [9, 6, 12, 8, 10]
TOKEN_BUDGET = 20


@pytest.mark.parametrize(("model_type", "executor"),
                         [(model_type, "eager") for model_type in sorted(ARCHITECTURES)] + [("mistral", "compiled")])
def test_logits_match_hf_eager_step_by_step(model_type, executor, tiny_model_dir, tiny_artifact, compiled_cache):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir(model_type), attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    engine = LLMEngine(tiny_artifact(model_type), EngineConfig(num_kv_blocks=64, max_num_batched_tokens=TOKEN_BUDGET,
                                                               max_num_seqs=8, executor=executor))
    assert engine.executor_kind == executor
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49000, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]
    for index in range(3):
        engine.add_request(prompts[index], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[index]))
    worst, compared, step, kinds = 0.0, 0, 0, set()
    while engine.has_unfinished_requests():
        if step == 2:  # late arrivals join while the first requests decode and prefill
            for index in (3, 4):
                engine.add_request(prompts[index], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[index]))
        engine.step()
        record = engine.last_step
        kinds.add(_step_kind(record))
        if (engine.runner.last_size or 0) > len(record.schedule.scheduled):
            kinds.add("padded decode")
        for row, scheduled_index in enumerate(record.inputs.sampled_rows):
            seq = record.schedule.scheduled[scheduled_index].seq
            context = torch.tensor([seq.token_ids[:seq.num_computed_tokens]])
            with torch.no_grad():
                expected = reference(context, logits_to_keep=1).logits[0, -1]  # the lm_head on the last row only
            worst = max(worst, (expected - record.logits[row].float()).abs().max().item())
            compared += 1
        step += 1
    assert compared == sum(MAX_TOKENS)
    assert worst <= 1e-4, f"max abs logits difference {worst}"
    assert "decode+chunked-prefill" in kinds, kinds
    assert ("padded decode" in kinds) == (executor == "compiled"), kinds
    assert_pool_full(engine)
    if model_type == "mistral":  # the window must actually cut the context of the longest sequences
        assert engine.artifact.kv_layout["sliding_windows"] == [TINY_WINDOW, TINY_WINDOW]
        assert max(PROMPT_LENGTHS) + max(MAX_TOKENS) > TINY_WINDOW


def _step_kind(record) -> str:
    decodes = sum(1 for item in record.schedule.scheduled if item.num_new_tokens == 1)
    chunks = sum(1 for item in record.schedule.scheduled if item.num_new_tokens > 1 and not item.samples)
    if decodes and chunks:
        return "decode+chunked-prefill"
    return "other"

