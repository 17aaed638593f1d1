"""Two engines on one bfloat16 artifact, stepped in turn under two settings of one environment variable, their
logits compared within the size of one bfloat16 rounding of the model.

The variable picks a kernel path that the C++ ops read at every call, so both engines run in one process: `first`
steps with it unset, `second` with it set. Every sampled row's logits must be within BF16_ERROR_FACTOR times the
size of one bfloat16 rounding of this model (HF bfloat16 against HF float32 on the same context) of each other,
and the greedy tokens must agree except at a near tie (the two tokens' logits on the second path within twice that
of each other), after which a sequence is compared no further.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo.compiler import compile_model
from octavo.config import CompileConfig, EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

BF16_ERROR_FACTOR = 2.0


def tiny_llama_d32(directory: Path, tokenizer_dir: Path) -> Path:
    """A tiny Llama with 32-dim heads (4 heads, 2 kv heads, hidden 128) and the test tokenizer in `directory`."""
    make_tiny_model("llama", hidden_size=128).save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def reference_models(model_dir: Path) -> tuple:
    """HF float32 and bfloat16 of `model_dir` (eager attention): their gap is the size of one bfloat16 rounding."""
    return tuple(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype).eval()
                 for dtype in (torch.float32, torch.bfloat16))


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """One prompt of random token ids (3 to 48999) per length, drawn in order from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (length,), generator=generator).tolist() for length in lengths]


def make_engine(artifact) -> LLMEngine:
    # The suite runs eagerly unless a test asks (tests/conftest.py); users' engines default to the compiled executor.
    return LLMEngine(artifact, EngineConfig(executor="compiled", num_kv_blocks=32, max_num_seqs=4,
                                            max_num_batched_tokens=32))


def default_engine_pair(model_dir: Path, artifact: Path, config: CompileConfig, variable: str,
                        monkeypatch: pytest.MonkeyPatch) -> tuple[LLMEngine, LLMEngine]:
    """`model_dir` compiled with `config` into `artifact`, and two engines on it as users get them (compiled executor,
    cpu backend: asserted), `variable` unset for largest_logit_difference to set for the second's steps."""
    compile_model(model_dir, artifact, config)
    monkeypatch.delenv(variable, raising=False)
    first, second = make_engine(artifact), make_engine(artifact)
    assert first.executor_kind == "compiled" and first.backend == "cpu"
    return first, second


def sampled(engine: LLMEngine) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Request id -> (the context its last step's logits row follows, that row), for the rows the step sampled."""
    record = engine.last_step
    rows = {}
    for row, index in enumerate(record.inputs.sampled_rows):
        seq = record.schedule.scheduled[index].seq
        rows[seq.request_id] = (seq.token_ids[:seq.num_computed_tokens], record.logits[row].float())
    return rows


def rounding_size(exact, hf_bf16, context: list[int]) -> float:
    with torch.no_grad():
        logits = [model(torch.tensor([context]), logits_to_keep=1).logits[0, -1].float() for model in (exact, hf_bf16)]
    return (logits[1] - logits[0]).abs().max().item()


def largest_logit_difference(first: LLMEngine, second: LLMEngine, variable: str | None, value: str | None,
                             models: tuple, prompts: list[list[int]], max_tokens: int,
                             monkeypatch: pytest.MonkeyPatch) -> float:
    """Runs `prompts` greedily on both engines (`second` with `variable`=`value`; no variable: two engines that
    differ by their own configuration), asserts the agreement of the module docstring at every sampled row, and
    returns the largest difference of two rows' logits."""
    exact, hf_bf16 = models
    for prompt in prompts:
        for engine in (first, second):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    diverged: set[str] = set()
    compared = equal_tokens = 0
    largest_difference = 0.0
    while first.has_unfinished_requests():
        if variable is not None:
            monkeypatch.delenv(variable, raising=False)
        first.step()
        if variable is not None:
            monkeypatch.setenv(variable, value)
        second.step()
        theirs = sampled(second)
        for request_id, (context, logits) in sampled(first).items():
            if request_id in diverged:
                continue
            assert theirs[request_id][0] == context
            bound = BF16_ERROR_FACTOR * rounding_size(exact, hf_bf16, context)
            difference = (logits - theirs[request_id][1]).abs().max().item()
            assert difference <= bound, f"{request_id}: logits {difference:.4f} apart, allowed {bound:.4f}"
            largest_difference = max(largest_difference, difference)
            compared += 1
            ours, reference = int(logits.argmax()), int(theirs[request_id][1].argmax())
            if ours == reference:
                equal_tokens += 1
                continue
            gap = (theirs[request_id][1][reference] - theirs[request_id][1][ours]).item()
            assert gap <= 2 * bound, f"{request_id}: token {ours}, the other path's {reference}, {gap:.4f} apart"
            diverged.add(request_id)
    if variable is not None:
        monkeypatch.delenv(variable, raising=False)
    assert not second.has_unfinished_requests()
    assert equal_tokens >= len(prompts) * max_tokens // 2, f"only {equal_tokens} of {compared} tokens equal"
    return largest_difference
